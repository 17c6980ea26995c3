"""``scalable-xd fit-table``: one's own CSV or Parquet table of values and errors, one command from a fitted
model, which equals the estimator's fit of the same arrays; a table that cannot be read so is refused,
naming the file, the column or the option."""

import logging

import numpy as np
import pandas as pd
import pytest

from scalable_xd import XDGMM
from scalable_xd.pipeline.cli import main

RNG = np.random.default_rng(4)
N = 600
TRUE = np.concatenate([RNG.normal([0, 0], 0.5, (N // 2, 2)), RNG.normal([4, 1], 0.4, (N // 2, 2))])
SIGMA = RNG.uniform(0.1, 0.3, (N, 2))
RHO = RNG.uniform(-0.5, 0.5, N)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    folder = tmp_path_factory.mktemp("table")
    frame = pd.DataFrame({"x": TRUE[:, 0], "y": TRUE[:, 1], "ex": SIGMA[:, 0], "ey": SIGMA[:, 1], "rho": RHO})
    frame.to_csv(folder / "stars.csv", index=False)
    frame.to_parquet(folder / "stars.parquet")
    return folder


@pytest.mark.parametrize("name", ["stars.csv", "stars.parquet"])
def test_a_table_is_one_command_from_the_estimators_fit(table, name, tmp_path):
    argv = ["-q", "fit-table", "--input", str(table / name), "--columns", "x", "y", "--errors", "ex", "ey"]
    argv += ["--correlation", "x:y=rho", "--n-components", "2", "--seed", "3", "--epochs", "5", "--n-init", "1"]
    assert main([*argv, "--output", str(tmp_path / "model.npz")]) == 0
    cov = np.einsum("ni,nj->nij", SIGMA, SIGMA) * np.where(np.eye(2, dtype=bool), 1.0, RHO[:, None, None])
    expected = XDGMM(2, n_init=1, epochs=5, random_state=3).fit(pd.DataFrame(TRUE, columns=["x", "y"]), Xcov=cov)
    loaded = XDGMM.load(tmp_path / "model.npz")
    # float32 fits: the table's noise is built from its errors batch by batch, the estimator's given dense,
    # and the two round apart by ~1e-9 here
    np.testing.assert_allclose(loaded.means_, expected.means_, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"--columns": ["x", "z"]}, "stars.csv lacks the columns z; it has x, y, ex, ey, rho"),
        ({"--errors": ["ex"]}, "1 --errors for 2 --columns"),
        ({"--correlation": ["x:q=rho"]}, "--correlation 'x:q=rho': give A:B=COLUMN"),
        ({"--input": "stars.txt"}, "stars.txt lacks the columns x, y, ex, ey"),  # bytes, read as a CSV
        ({"--input": "stars.bin"}, "is not a readable Parquet (or name it .csv) file"),
    ],
)
def test_a_table_that_cannot_be_fitted_so_is_named(table, tmp_path, caplog, change, message):
    (table / "stars.txt").write_bytes(b"\x00\x01")
    (table / "stars.bin").write_text("x,y\n1,2\n")
    options = {"--input": "stars.csv", "--columns": ["x", "y"], "--errors": ["ex", "ey"], "--correlation": []}
    options.update(change)
    options["--input"] = str(table / options["--input"])
    argv = ["fit-table", "--n-components", "2", "--output", str(tmp_path / "m.npz")]
    for flag, value in options.items():
        argv += [flag, *(value if isinstance(value, list) else [value])]
    with caplog.at_level(logging.ERROR, logger="scalable_xd"):
        assert main(argv) == 1
    assert any(message in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert not (tmp_path / "m.npz").exists()


@pytest.mark.parametrize(
    ("column", "row", "value", "message"),
    [
        ("ey", 4, -0.2, "column ey holds a negative or missing error of y in row 4: -0.2"),
        ("ex", 7, np.nan, "column ex holds a negative or missing error of x in row 7: nan"),
        ("rho", 2, 1.5, "column rho holds a correlation outside [-1, 1] in row 2: 1.5"),
        ("x", 9, np.inf, "column x holds an infinite or missing value in row 9: inf"),
    ],
)
def test_a_damaged_value_is_named_by_its_column_and_row(tmp_path, caplog, column, row, value, message):
    frame = pd.DataFrame(
        {"x": TRUE[:20, 0], "y": TRUE[:20, 1], "ex": SIGMA[:20, 0], "ey": SIGMA[:20, 1], "rho": RHO[:20]}
    )
    frame.loc[row, column] = value
    frame["name"] = "star"  # a column of text the fit does not read
    frame.to_csv(tmp_path / "stars.csv", index=False)
    argv = ["fit-table", "--input", str(tmp_path / "stars.csv"), "--columns", "x", "y", "--errors", "ex", "ey"]
    argv += ["--correlation", "x:y=rho", "--n-components", "2", "--output", str(tmp_path / "m.npz")]
    with caplog.at_level(logging.ERROR, logger="scalable_xd"):
        assert main(argv) == 1
    assert any(message in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert not (tmp_path / "m.npz").exists()


def test_a_header_without_rows_is_named_and_a_missing_value_may_miss_its_error(tmp_path, caplog):
    (tmp_path / "empty.csv").write_text("x,y,ex,ey\n")
    argv = ["fit-table", "--columns", "x", "y", "--errors", "ex", "ey", "--n-components", "1"]
    with caplog.at_level(logging.ERROR, logger="scalable_xd"):
        assert main([*argv, "--input", str(tmp_path / "empty.csv"), "--output", str(tmp_path / "m.npz")]) == 1
    assert "empty.csv has no rows: only its header" in caplog.text
    frame = pd.DataFrame({"x": TRUE[:, 0], "y": TRUE[:, 1], "ex": SIGMA[:, 0], "ey": SIGMA[:, 1]})
    frame.loc[3, ["y", "ey"]] = np.nan  # y not measured in row 3: its error is missing too
    frame.to_csv(tmp_path / "stars.csv", index=False)
    options = ["--epochs", "2", "--n-init", "1", "--input", str(tmp_path / "stars.csv")]
    with caplog.at_level(logging.ERROR, logger="scalable_xd"):
        assert main([*argv, *options, "--output", str(tmp_path / "m.npz")]) == 1
    assert (
        "column y holds an infinite or missing value in row 3: nan (give --missing marginalise to fit rows"
        in caplog.text
    )
    options += ["--missing", "marginalise"]
    assert main(["-q", *argv, *options, "--output", str(tmp_path / "m.npz")]) == 0
    assert list(XDGMM.load(tmp_path / "m.npz").feature_names_in_) == ["x", "y"]  # the columns fitted
