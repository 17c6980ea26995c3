"""How a subcommand of ``scalable-xd`` is declared: a ``Command`` row, its options as ``(flags, keywords)``
pairs, the options made from a settings dataclass's fields, and the options several subcommands share."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from ...fit.methods import SETTING_CHOICES, setting_help
from ...settings import FitSettings
from .. import steps


def count(minimum: int):
    """An argparse type: an integer no smaller than ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


POSITIVE, NON_NEGATIVE = count(1), count(0)


def optional(parse):
    """``parse``, with "none" or "null" read as None."""

    def parse_optional(text: str):
        return None if text.lower() in ("none", "null") else parse(text)

    return parse_optional


def add_settings(p, cls, *, skip=(), prefix="", defaults=None) -> None:
    """An option per field of a settings dataclass: its help line, its default (``defaults`` overrides) and
    its choices (the method table's and the kernel's where they own them); integers must be at least the
    field's lower bound."""
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        meta, default = f.metadata, (defaults or {}).get(f.name, f.default)
        flag = f"--{prefix}{f.name.replace('_', '-')}"
        kind = str(f.type).split("|")[0].strip()
        # argparse formats help with %: a literal one (in "90% of") must be doubled
        text = setting_help(f.name, meta["help"]) if cls is FitSettings else meta["help"]
        help_text = f"{text} (default: {default})".replace("%", "%%")
        if kind == "bool":
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            parse = {"int": count(meta["low"]) if meta["low"] is not None else int, "float": float, "str": str}[kind]
            if meta["nullable"]:
                metavar = ("TEXT" if kind == "str" else "X") + "|none"
                p.add_argument(
                    flag, dest=f.name, type=optional(parse), default=default, metavar=metavar, help=help_text
                )
            else:
                choices = SETTING_CHOICES.get(f.name, meta["choices"]) if cls is FitSettings else meta["choices"]
                p.add_argument(flag, dest=f.name, type=parse, default=default, choices=choices, help=help_text)


def settings_of(args, cls, **fixed):
    """The settings ``cls`` from the parsed options, with ``fixed`` values in place of any of them."""
    return cls(**{**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}, **fixed})


@dataclass(frozen=True)
class Command:
    """A subcommand: what it does, its options (``(flags, add_argument keywords)`` pairs) and what runs it:
    the ``steps`` function of that name, given every option under its destination's name (or the one
    ``rename`` gives); or ``run``, given the parsed arguments, where the options make settings. ``settings``
    adds the options of the settings' fields (``add_settings``'s keywords per settings class)."""

    name: str
    help: str
    options: tuple = ()
    step: str | None = None
    rename: dict = field(default_factory=dict)
    run: Callable | None = None
    settings: tuple = ()


def option(*flags: str, **keywords) -> tuple:
    return flags, keywords


def destination(flags, keywords) -> str:
    return keywords.get("dest") or flags[0].lstrip("-").replace("-", "_")


def runner(command: Command) -> Callable:
    """What runs ``command`` from the parsed arguments: its ``run``, or its step given every option by name."""
    if command.run is not None:
        return command.run
    step = getattr(steps, str(command.step))

    def run_step(args) -> None:
        given = {destination(*o): getattr(args, destination(*o)) for o in command.options}
        step(**{command.rename.get(name, name): value for name, value in given.items()})

    return run_step


def seed_option(what: str) -> tuple:
    return option("--seed", type=NON_NEGATIVE, default=0, help=f"{what} (default: 0)")


THREADS = option("--threads", type=NON_NEGATIVE, default=0, help="CPU threads for torch (default: 0, torch's own)")


METRICS = option("--metrics", nargs="+", required=True, help="metrics files of the fits")


IMAGES = option("--output", nargs="+", required=True, help="one or more image files (.png, .pdf)")


MODEL = option("--model", required=True, help="a model file (XDGMM.save)")


DENOISED = option("--denoised", required=True, help="a denoised catalogue (scalable-xd denoise)")


DATA = option("--data", required=True, help="a features file (e.g. test.parquet)")


FIT_METRICS = option(
    "--metrics",
    help="the model's metrics.json: the figure names the fit by its settings (a variant by what sets it apart)",
)
