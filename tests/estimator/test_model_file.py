"""XDGMM.load refuses damaged, foreign and invalid model files with a message that names the file."""

import json

import numpy as np
import pytest
from helpers import damage_file

from scalable_xd import XDGMM
from scalable_xd.model_file import checksum


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(-2, 1, (300, 2)), rng.normal(2, 1, (300, 2))])
    path = tmp_path_factory.mktemp("model") / "model.npz"
    XDGMM(2, epochs=3, device="cpu", random_state=0).fit(x, Xcov=np.full((600, 2), 0.1)).save(path)
    with np.load(path) as archive:
        return path, {key: archive[key] for key in archive.files}


def _rewrite(path, arrays, **changes):
    """The file with ``changes``, its checksum recomputed (as a file written by other code would have
    it), so that what is tested is the validation of its contents."""
    arrays = {**arrays, **changes}
    meta = json.loads(str(arrays["meta"]))
    meta["sha256"] = checksum({key: value for key, value in arrays.items() if key != "meta"})
    np.savez(path, **{**arrays, "meta": np.array(json.dumps(meta))})
    return path


def test_a_damaged_array_is_refused_by_its_checksum(saved, tmp_path):
    """A flipped value that still makes a valid mixture (the weights 0.4/0.6 for 0.6/0.4) would load as
    another model; the checksum refuses it."""
    path, arrays = saved
    swapped = arrays["weights"][::-1].copy()
    np.savez(tmp_path / "model.npz", **{**arrays, "weights": swapped})
    with pytest.raises(ValueError, match=f"{tmp_path / 'model.npz'} is damaged: its arrays do not match"):
        XDGMM.load(tmp_path / "model.npz")


def test_a_saved_model_loads(saved):
    path, arrays = saved
    np.testing.assert_array_equal(XDGMM.load(path).weights_, arrays["weights"])


def test_a_model_loads_quiet_whatever_its_fit_printed(tmp_path):
    """verbose is how the fitting process showed its progress (the workflow's fits: every epoch), not part
    of the model: it comes back at its default."""
    x = np.random.default_rng(1).normal(size=(200, 2))
    XDGMM(2, epochs=2, verbose=2, random_state=0).fit(x).save(tmp_path / "loud.npz")
    loaded = XDGMM.load(tmp_path / "loud.npz")
    assert loaded.verbose == 0 and "verbose" not in repr(loaded)


@pytest.mark.parametrize(
    "damage, message",
    [
        ("empty", "is empty, truncated or of another format"),
        ("truncated", "is empty, truncated or of another format"),
        ("garbage", "is empty, truncated or of another format"),
        ("no meta", r"it lacks meta"),
        ("pickled meta", "holds Python objects, which are never loaded"),
        ("meta not JSON", "is empty, truncated or of another format"),
        ("a .npy array", r"it is a single array \(.npy\), not an .npz archive"),
    ],
)
def test_damaged_or_foreign_files_are_refused_by_name(saved, tmp_path, damage, message):
    path, arrays = saved
    target = tmp_path / "model.npz"
    target.write_bytes(path.read_bytes())
    if damage_file(target, damage):
        pass
    elif damage == "no meta":
        np.savez(target, **{k: v for k, v in arrays.items() if k != "meta"})
    elif damage == "pickled meta":
        np.savez(target, **{**arrays, "meta": np.array([{"format_version": 1}], dtype=object)})
    elif damage == "a .npy array":
        with open(target, "wb") as handle:  # np.save to a file object keeps the .npz name
            np.save(handle, arrays["means"])
    else:
        np.savez(target, **{**arrays, "meta": np.array("{not json")})
    with pytest.raises(ValueError, match=f"{target} is not a model written by XDGMM.save.*{message}"):
        XDGMM.load(target)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(weights=np.array([np.nan, 0.5])), "weights of component 0 contain NaN or inf"),
        (dict(weights=np.array([2.5, 2.5])), "weights sum to 5, not 1"),
        (dict(weights=np.array([1.5, -0.5])), "weight of component 1 is negative"),
        (dict(weights=np.array([1.0])), r"weights \(1,\) and means \(2, 2\) must have shapes \(K,\) and \(K, D\)"),
        (
            dict(covariances=np.array([np.eye(2), [[1.0, 2.0], [2.0, 1.0]]])),
            "component 1 has a covariance that is not positive definite",
        ),
        (
            dict(covariances=np.array([np.eye(2), [[1.0, 0.5], [0.0, 1.0]]])),
            "covariance of component 1 is not symmetric",
        ),
        (dict(covariances=np.eye(2)[None]), r"covariances must have shape \(K, D, D\) = \(2, 2, 2\)"),
        (dict(weights=np.array([1, 0])), "must be floating-point arrays"),
    ],
)
def test_invalid_parameters_are_refused_as_a_fit_would_be(saved, tmp_path, change, message):
    path, arrays = saved
    target = _rewrite(tmp_path / "model.npz", arrays, **change)
    with pytest.raises(ValueError, match=f"{target}.*{message}"):
        XDGMM.load(target)


def test_invalid_settings_and_versions_name_the_file(saved, tmp_path):
    path, arrays = saved
    meta = json.loads(str(arrays["meta"]))
    bad = {**meta, "params": {**meta["params"], "method": "magic"}}
    target = _rewrite(tmp_path / "model.npz", arrays, meta=np.array(json.dumps(bad)))
    with pytest.raises(ValueError, match=f"model {target} has invalid settings: unknown method 'magic'"):
        XDGMM.load(target)
    target = _rewrite(tmp_path / "model.npz", arrays, meta=np.array(json.dumps({**meta, "format_version": 99})))
    with pytest.raises(ValueError, match=f"{target}: unsupported model format version 99"):
        XDGMM.load(target)


def test_every_damaged_byte_range_is_refused_or_harmless(saved, tmp_path):
    """Each 64-byte block of a model file (with a running state) overwritten in turn: loading either refuses
    the file naming it or gives the undamaged model."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(300, 2))
    path = tmp_path / "online.npz"
    XDGMM(2, "minibatch_em", random_state=0).partial_fit(x, Xcov=np.full((300, 2), 0.1)).save(path)
    intact, model = path.read_bytes(), XDGMM.load(path)
    for start in range(0, len(intact), 64):
        damaged = bytearray(intact)
        damaged[start : start + 64] = bytes(255 - b for b in damaged[start : start + 64])
        path.write_bytes(bytes(damaged))
        try:
            loaded = XDGMM.load(path)
        except ValueError as err:
            assert str(path) in str(err), err
            continue
        for attr in ("weights_", "means_", "covariances_"):
            np.testing.assert_array_equal(getattr(loaded, attr), getattr(model, attr))
