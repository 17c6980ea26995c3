"""Checkpoints run no code, resume only the fit that wrote them, and name the file when they cannot."""

import os

import numpy as np
import pytest
import torch
from helpers import damage_file

from scalable_xd import XDGMM
from scalable_xd.fit.run import checkpoint
from scalable_xd.fit.run.checkpoint import CheckpointError

SETTINGS = dict(n_components=2, n_init=1, method="minibatch_em", epochs=2, batch_size=100, device="cpu", random_state=0)


def _data(seed, n=600):
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.normal(-2, 1, size=(n // 2, 2)), rng.normal(2, 1, size=(n // 2, 2))])
    return x, np.full((n, 2), 0.1)


def _named(seed):
    """``_data(seed)`` as fit's arguments by name."""
    x, noise = _data(seed)
    return {"X": x, "Xcov": noise}


@pytest.fixture
def finished(tmp_path):
    """A checkpoint left by a completed fit of data set 0, as `fit` leaves it."""
    path = tmp_path / "fit.ckpt"
    XDGMM(**SETTINGS).fit(**_named(0), checkpoint=path)
    return path


class _Payload:
    """What an attacker would plant: unpickling it creates a directory (a stand-in for any command)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_a_checkpoint_carrying_a_pickle_payload_runs_nothing(finished, tmp_path):
    marker = tmp_path / "payload-ran"
    state = checkpoint.load(finished)
    state["history"].append(_Payload(marker))
    checkpoint.write_state(finished, state)  # with a checksum that matches: the payload itself must be refused
    with pytest.raises(CheckpointError, match=f"checkpoint {finished} holds objects other than tensors.*delete"):
        XDGMM(**SETTINGS).fit(**_named(0), checkpoint=finished)
    assert not marker.exists()


def test_a_checkpoint_of_other_data_of_the_same_shape_is_refused(finished):
    with pytest.raises(CheckpointError, match=r"different fit \(other data: data '[0-9a-f]{16}' in the checkpoint"):
        XDGMM(**SETTINGS).fit(**_named(1), checkpoint=finished)
    x, S = _data(0)
    x[599, 1] += 1e-9  # one value of the last row
    with pytest.raises(CheckpointError, match="other data"):
        XDGMM(**SETTINGS).fit(x, Xcov=S, checkpoint=finished)
    S[0, 0] = 0.2  # the noise of a sampled row (the first always is), with X back as it was
    with pytest.raises(CheckpointError, match="other data"):
        XDGMM(**SETTINGS).fit(_data(0)[0], Xcov=S, checkpoint=finished)
    with pytest.raises(CheckpointError, match="val_data None in the checkpoint"):
        XDGMM(**SETTINGS).fit(**_named(0), X_val=_data(2)[0], Xcov_val=_data(2)[1], checkpoint=finished)
    with pytest.raises(CheckpointError, match="other data: init"):
        XDGMM(**SETTINGS, means_init=[[-2, 0], [2, 0]]).fit(**_named(0), checkpoint=finished)
    weights = np.ones(600)
    with pytest.raises(CheckpointError, match="other data"):  # weights of one everywhere are still other data
        XDGMM(**SETTINGS).fit(**_named(0), sample_weight=weights, checkpoint=finished)


def test_fixed_parameters_and_weights_are_part_of_the_fingerprint(tmp_path):
    path, weights = tmp_path / "fit.ckpt", np.linspace(0.5, 2.0, 600)
    XDGMM(**SETTINGS, fix_means=np.array([True, False])).fit(**_named(0), sample_weight=weights, checkpoint=path)
    resumed = XDGMM(**SETTINGS, fix_means=np.array([True, False])).fit(
        **_named(0), sample_weight=weights, checkpoint=path
    )
    assert resumed.n_iter_ == 2
    with pytest.raises(CheckpointError, match=r"other settings: fix_means \[True, False\] in the checkpoint"):
        XDGMM(**SETTINGS).fit(**_named(0), sample_weight=weights, checkpoint=path)
    weights[300] = 1.0  # one weight
    with pytest.raises(CheckpointError, match="other data"):
        XDGMM(**SETTINGS, fix_means=np.array([True, False])).fit(**_named(0), sample_weight=weights, checkpoint=path)


def test_another_k_is_named_first_and_its_masks_shortly(tmp_path):
    """A checkpoint of K = 16 offered to a fit of K = 2: K leads, the K-long masks are summarised."""
    path = tmp_path / "fit.ckpt"
    XDGMM(**{**SETTINGS, "n_components": 16}).fit(**_named(0), checkpoint=path)
    with pytest.raises(CheckpointError) as refused:
        XDGMM(**SETTINGS).fit(**_named(0), checkpoint=path)
    message = str(refused.value)
    assert "(other settings: n_components 16 in the checkpoint, 2 now;" in message
    assert "[False, False, False, False, ... (16 entries)] in the checkpoint" in message
    assert len(message) < 600


def test_the_same_data_resumes_and_other_settings_are_named(finished):
    resumed = XDGMM(**SETTINGS).fit(**_named(0), checkpoint=finished)
    assert resumed.n_iter_ == 2
    with pytest.raises(CheckpointError, match="other settings: w 1e-06 in the checkpoint, 0.5 now"):
        XDGMM(**{**SETTINGS, "w": 0.5}).fit(**_named(0), checkpoint=finished)


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage", "a tensor", "format 2"])
def test_damaged_or_foreign_checkpoints_name_the_file(finished, damage):
    if damage_file(finished, damage):
        pass
    elif damage == "a tensor":
        torch.save(torch.zeros(3), finished)
    else:
        state = checkpoint.load(finished)
        state["format"] = 2
        checkpoint.write_state(finished, state)
    expected = {
        "format 2": f"has format 2, this version of scalable-xd reads format {checkpoint.FORMAT}",
        "a tensor": "is not a scalable-xd checkpoint",
    }.get(damage, "is empty, truncated or not a checkpoint")
    with pytest.raises(CheckpointError, match=f"checkpoint {finished} {expected}.*delete {finished}"):
        XDGMM(**SETTINGS).fit(**_named(0), checkpoint=finished)


def test_the_digest_sees_every_row_of_the_noise(finished):
    """Noise multiplied by 4 everywhere but on the rows the digest hashes in full: other data, refused
    (the digest summed only X's columns, and the old model was returned)."""
    x, S = _data(0)
    sampled = np.unique(np.linspace(0, len(x) - 1, checkpoint.DIGEST_ROWS).astype(np.int64))
    louder = S * 4
    louder[sampled] = S[sampled]
    with pytest.raises(CheckpointError, match="other data"):
        XDGMM(**SETTINGS).fit(x, Xcov=louder, checkpoint=finished)


def test_every_damaged_byte_range_is_refused_or_harmless(finished):
    """Each 64-byte block of the file overwritten in turn (a bad sector, a torn write): the fit either
    refuses the checkpoint naming it or, where the block held nothing that is read, resumes to the
    undamaged fit. Before the checksum, flipped bytes in the tensor data resumed into a wrong model
    (weights summing to -12.7)."""
    intact = finished.read_bytes()
    resumed = XDGMM(**SETTINGS).fit(**_named(0), checkpoint=finished)
    refused = 0
    for start in range(0, len(intact), 64):
        damaged = bytearray(intact)
        damaged[start : start + 64] = bytes(255 - b for b in damaged[start : start + 64])
        finished.write_bytes(bytes(damaged))
        try:
            model = XDGMM(**SETTINGS).fit(**_named(0), checkpoint=finished)
        except CheckpointError as err:
            assert str(finished) in str(err)
            refused += 1
            continue
        np.testing.assert_array_equal(model.means_, resumed.means_)
    assert refused > len(intact) // 64 // 2


def test_a_state_with_a_valid_checksum_but_an_invalid_model_is_refused(finished):
    """The checksum vouches for the bytes, not for what wrote them: a state whose means are NaN, or cut to
    another shape, is refused before the fit trusts it."""
    for damage in ("nan", "shape"):
        state = checkpoint.load(finished)
        fitter = state["fitter"]
        mixture = fitter["state"] if "state" in fitter else fitter["mixture"]
        mixture["means"] = mixture["means"][:, :1] if damage == "shape" else torch.full_like(mixture["means"], np.nan)
        checkpoint.write_state(finished, state)
        with pytest.raises(CheckpointError, match=f"checkpoint {finished} (holds|.*means).*delete {finished}"):
            XDGMM(**SETTINGS).fit(**_named(0), checkpoint=finished)
        finished.unlink()
        XDGMM(**SETTINGS).fit(**_named(0), checkpoint=finished)  # a fresh, finished checkpoint again


def test_the_digest_is_independent_of_the_array_container():
    from scalable_xd.data.dataset import Dataset

    x, S = _data(0)
    as_numpy = checkpoint.data_digest(Dataset(x, S))
    assert checkpoint.data_digest(Dataset(torch.as_tensor(x), torch.as_tensor(S))) == as_numpy
    assert checkpoint.data_digest(Dataset(x[::-1].copy(), S)) != as_numpy
