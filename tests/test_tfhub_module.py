"""A TF-Hub ELMo module on disk, read without TensorFlow (elmokit.model.tf_bundle and
elmokit.sources.tfhub): the module folder and .tar.gz in tests/fixtures/tfhub were written by
TensorFlow 2.15.1 and tensorflow_hub 0.15.0 (their README and make_fixture.py) from the golden
fixture's HDF5 weights, so every number here has the HDF5 path as its independent expectation."""

from __future__ import annotations

import hashlib
import io
import json
import re
import shutil
import tarfile
import tracemalloc
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from elmokit import ElmoEmbedder, hub, load_model
from elmokit.cli import main
from elmokit.inference.elmo import Elmo
from elmokit.model.chars import batch_to_ids
from elmokit.model.errors import WeightFileError
from elmokit.model.tf_bundle import crc32c, read_index, read_tensors, unmask_crc
from elmokit.sources.tfhub import VARIABLES, cached_module, load_tfhub_module, module_folder, module_mix
from elmokit.model.weights import load_original
from tests.conftest import FIXTURE, REPO, one_error_line
from tests.tf_bundle_writer import write_bundle

TFHUB = REPO / "tests" / "fixtures" / "tfhub"
MODULE = TFHUB / "elmo-module"
ARCHIVE = TFHUB / "elmo-module.tar.gz"
LSTMCELL_NAMES = TFHUB / "lstmcell-names"
EXPECTED = json.loads((TFHUB / "expected.json").read_text(encoding="utf-8"))
MIX_WEIGHTS, MIX_SCALING = [0.3, -0.5, 0.9], 1.7  # what make_fixture.py gave aggregation/*
SENTENCES = [["The", "cat", "sat", "on", "the", "mat", "."], ["Dogs", "bark"], ["naïve", "café", "東京"]]


@pytest.fixture(autouse=True)
def private_caches(tmp_path, monkeypatch):
    """Extracted archives go to a cache of the test's own; TF-Hub's cache is the test's too."""
    monkeypatch.setenv("ELMOKIT_CACHE", str(tmp_path / "elmokit-cache"))
    monkeypatch.setenv("TFHUB_CACHE_DIR", str(tmp_path / "tfhub-cache"))
    monkeypatch.setenv("ELMOKIT_OFFLINE", "1")


@pytest.fixture(scope="module")
def reference():
    """The same weights from the original HDF5 file."""
    return load_original(FIXTURE / "options.json", FIXTURE / "lm_weights.hdf5")


def assert_same_weights(model, reference):
    assert model.config == reference.config
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor, rtol=0, atol=1e-5, msg=name)


# ---------------------------------------------------------------------------------------------
# The checkpoint reader against what TensorFlow wrote
# ---------------------------------------------------------------------------------------------
def test_crc32c_known_values():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value (RFC 3720)
    assert crc32c(b"") == 0 and crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720's 32 zero bytes
    assert crc32c(bytes(range(32))) == 0x46DD794E


@pytest.mark.parametrize("n_bytes", [1, 5, 63, 4096, 4097, 100_003])
def test_crc32c_equals_the_bitwise_definition(n_bytes):
    data = np.random.default_rng(n_bytes).integers(0, 256, n_bytes, dtype=np.uint8).tobytes()
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    assert crc32c(data) == crc ^ 0xFFFFFFFF


@pytest.mark.parametrize("folder", ["elmo-module", "lstmcell-names"])
def test_every_variable_reads_as_tensorflow_wrote_it(folder):
    prefix = TFHUB / folder / VARIABLES
    entries = read_index(prefix.with_name("variables.index"))
    written = {record["name"]: record for record in EXPECTED[folder]["variables"]}  # by TensorFlow's reader
    assert sorted(entries) == sorted(written)
    arrays = read_tensors(prefix, entries, list(entries))
    for name, record in written.items():
        assert list(arrays[name].shape) == record["shape"], name
        values = arrays[name].astype(np.float64)
        assert values.sum() == pytest.approx(record["sum"], rel=1e-9, abs=1e-9), name
        assert (values ** 2).sum() == pytest.approx(record["sum_sq"], rel=1e-9), name
        assert hashlib.sha256(arrays[name].astype("<f4").tobytes()).hexdigest() == record["sha256_le_bytes"], name


def test_entry_crcs_are_those_of_the_tensor_bytes():
    prefix = MODULE / VARIABLES
    entries = read_index(prefix.with_name("variables.index"))
    data = prefix.with_name("variables.data-00000-of-00001").read_bytes()
    for entry in entries.values():
        assert unmask_crc(entry.crc32c) == crc32c(data[entry.offset:entry.offset + entry.size]), entry.name


# ---------------------------------------------------------------------------------------------
# The module's biLM and mix = the HDF5 file's
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("source", [MODULE, LSTMCELL_NAMES, ARCHIVE], ids=["folder", "lstmcell-names", "tar.gz"])
def test_module_weights_equal_the_hdf5_files(source, reference):
    assert_same_weights(load_model(source), reference)


def test_the_golden_outputs_through_a_module(reference):
    """ElmoEmbedder(FOLDER) and Elmo(FOLDER) give the HDF5 path's vectors (1e-5)."""
    expected = ElmoEmbedder(module=reference).embed_many(SENTENCES)
    for got, want in zip(ElmoEmbedder(str(MODULE)).embed_many(SENTENCES), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    char_ids = batch_to_ids(SENTENCES)
    ours = Elmo(str(MODULE), None, 1, dropout=0.0, scalar_mix_parameters=[0.1, 0.2, 0.3])(char_ids)
    theirs = Elmo(module=reference, num_output_representations=1, dropout=0.0,
                  scalar_mix_parameters=[0.1, 0.2, 0.3])(char_ids)
    torch.testing.assert_close(ours["elmo_representations"][0], theirs["elmo_representations"][0], rtol=0, atol=1e-5)


def test_hub_module_from_disk_has_the_modules_mix(reference):
    """hub.Module(FOLDER): the layers as from the HDF5 file, `elmo` = scaling * sum softmax(weights)_j h_j
    with the module's own aggregation values, and with trainable=True only those 4 scalars train."""
    texts = ["the cat is on the mat", "dogs are in the fog"]
    module = hub.Module(str(MODULE), trainable=True)
    outputs = module(texts, as_dict=True)
    plain = hub.Module(("%s" % (FIXTURE / "options.json"), str(FIXTURE / "lm_weights.hdf5")))(texts, as_dict=True)
    for name in ("word_emb", "lstm_outputs1", "lstm_outputs2", "sequence_len"):
        torch.testing.assert_close(outputs[name], plain[name], rtol=0, atol=1e-5)
    layers = [torch.cat([plain["word_emb"]] * 2, -1), plain["lstm_outputs1"], plain["lstm_outputs2"]]
    weights = np.exp(MIX_WEIGHTS) / np.exp(MIX_WEIGHTS).sum()
    expected = MIX_SCALING * sum(float(w) * layer for w, layer in zip(weights, layers))
    torch.testing.assert_close(outputs["elmo"], expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(outputs["elmo"], plain["elmo"], atol=1e-3)  # the equal-weight mix differs
    trainable = sorted(name for name, p in module.named_parameters() if p.requires_grad)
    assert trainable == ["elmo.mix.gamma", "elmo.mix.scalar_parameters"]
    assert module_mix(MODULE) == (pytest.approx(MIX_WEIGHTS), pytest.approx(MIX_SCALING))
    signature = hub.load(str(ARCHIVE)).signatures["default"](texts)
    torch.testing.assert_close(signature["elmo"], outputs["elmo"].detach())


def test_a_handle_uses_the_module_tfhub_cached(tmp_path, reference):
    """hub.Module("https://tfhub.dev/google/elmo/3") takes TF-Hub's cached copy (its folder is the
    SHA-1 of the handle as given) before any download (offline here: a download would fail)."""
    handle = "https://tfhub.dev/google/elmo/3"
    assert cached_module(handle) is None
    shutil.copytree(MODULE, tmp_path / "tfhub-cache" / hashlib.sha1(handle.encode()).hexdigest())
    assert cached_module(handle) is not None
    module = hub.Module(handle)
    assert_same_weights(module.elmo.bilm, reference)
    assert module.elmo.mix.gamma.item() == pytest.approx(MIX_SCALING)
    assert cached_module("https://tfhub.dev/google/elmo/2") is None  # another handle, another folder


def test_commands_take_a_module_folder(tmp_path, capsys, reference):
    (tmp_path / "in.txt").write_text("The cat sat .\nDogs bark\n", encoding="utf-8")
    for model, out in ((MODULE, "folder.npz"), (ARCHIVE, "archive.npz")):
        assert main(["embed", str(tmp_path / "in.txt"), str(tmp_path / out), "--model", str(model)]) == 0
    assert main(["embed", str(tmp_path / "in.txt"), str(tmp_path / "hdf5.npz"), "--options-file",
                 str(FIXTURE / "options.json"), "--weight-file", str(FIXTURE / "lm_weights.hdf5")]) == 0
    with np.load(tmp_path / "folder.npz") as a, np.load(tmp_path / "archive.npz") as b, \
            np.load(tmp_path / "hdf5.npz") as c:
        assert sorted(a.files) == sorted(c.files)
        for key in c.files:
            if c[key].dtype.kind == "f":
                np.testing.assert_allclose(a[key], c[key], atol=1e-5)
                np.testing.assert_allclose(b[key], c[key], atol=1e-5)


def test_convert_writes_original_and_native_files_naming_the_module(tmp_path, reference):
    assert main(["convert", "--model", str(MODULE), "--to-native", str(tmp_path / "native")]) == 0
    assert main(["convert", "--model", str(ARCHIVE), "--to-original", str(tmp_path / "o.json"),
                 str(tmp_path / "w.hdf5")]) == 0
    assert_same_weights(load_model(tmp_path / "native"), reference)
    assert_same_weights(load_original(tmp_path / "o.json", tmp_path / "w.hdf5"), reference)
    with h5py.File(tmp_path / "w.hdf5") as converted, h5py.File(FIXTURE / "lm_weights.hdf5") as original:
        assert sorted(converted) == sorted(original)
    native = json.loads((tmp_path / "native" / "provenance.json").read_text())
    options = json.loads((tmp_path / "o.json").read_text())["elmokit_provenance"]
    for record in (native, options):
        assert record["converted_from"] == "TF-Hub module"
        assert record["elmo_mix"]["weights"] == pytest.approx(MIX_WEIGHTS)
        assert record["variables_index_sha256"] == hashlib.sha256(
            (MODULE / "variables" / "variables.index").read_bytes()).hexdigest()
    assert native["module_folder"] == str(MODULE.resolve()) and "module_archive" not in native
    assert options["module_archive"] == str(ARCHIVE.resolve())  # the archive the user gave, not its extraction


def test_convert_to_original_takes_a_folder_or_two_paths(tmp_path, reference, capsys):
    """`--to-original DIR` writes DIR/options.json and DIR/weights.hdf5 (the folder made); one path
    that is a file, or three paths, are refused naming the two forms."""
    assert main(["convert", "--model", str(MODULE), "--to-original", str(tmp_path / "out")]) == 0
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["options.json", "weights.hdf5"]
    assert_same_weights(load_original(tmp_path / "out" / "options.json", tmp_path / "out" / "weights.hdf5"), reference)
    capsys.readouterr()
    (tmp_path / "file").write_text("mine\n")
    assert main(["convert", "--model", str(MODULE), "--to-original", str(tmp_path / "file")]) == 2
    one_error_line(capsys, "--to-original", "is a file", "OPTIONS WEIGHTS")
    assert (tmp_path / "file").read_text() == "mine\n"
    assert main(["convert", "--model", str(MODULE), "--to-original", str(tmp_path / "weights.hdf5")]) == 2
    one_error_line(capsys, "names a file: give both")
    assert not (tmp_path / "weights.hdf5").exists()
    assert main(["convert", "--model", str(MODULE), "--to-original", "a", "b", "c"]) == 2
    one_error_line(capsys, "a folder DIR or the two files OPTIONS WEIGHTS, got 3 paths")


def test_a_module_folder_where_a_trained_model_is_needed_says_what_reads_it(capsys, tmp_path):
    assert main(["export", str(MODULE), "--native", str(tmp_path / "x")]) == 2
    one_error_line(capsys, "TF-Hub", "elmo convert --model", "docs/loading.md")


# ---------------------------------------------------------------------------------------------
# Hostile and wrong inputs: one clear error, nothing big allocated
# ---------------------------------------------------------------------------------------------
def module_copy(tmp_path) -> Path:
    folder = tmp_path / "module"
    shutil.copytree(MODULE, folder)
    return folder


def fixture_tensors() -> dict[str, np.ndarray]:
    prefix = MODULE / VARIABLES
    entries = read_index(prefix.with_name("variables.index"))
    return read_tensors(prefix, entries, list(entries))


def test_truncated_index(tmp_path):
    folder = module_copy(tmp_path)
    index = folder / "variables" / "variables.index"
    index.write_bytes(index.read_bytes()[:-20])
    with pytest.raises(WeightFileError, match="truncated"):
        load_model(folder)
    index.write_bytes((MODULE / "variables" / "variables.index").read_bytes()[:200]
                      + (MODULE / "variables" / "variables.index").read_bytes()[-48:])
    with pytest.raises(WeightFileError, match="variables.index"):
        load_model(folder)


def flip_bit(path: Path, at: int) -> None:
    damaged = bytearray(path.read_bytes())
    damaged[at] ^= 0x01
    path.write_bytes(bytes(damaged))


def test_damaged_data_and_index_fail_their_crc(tmp_path):
    folder = module_copy(tmp_path)
    flip_bit(folder / "variables" / "variables.data-00000-of-00001", 1000)
    with pytest.raises(WeightFileError, match="CRC32C of tensor .* does not match"):
        load_model(folder)
    folder = module_copy(tmp_path / "second")
    flip_bit(folder / "variables" / "variables.index", 30)
    with pytest.raises(WeightFileError, match="CRC32C of its data block"):
        load_model(folder)


def test_a_data_file_short_by_a_few_bytes(tmp_path):
    folder = module_copy(tmp_path)
    data = folder / "variables" / "variables.data-00000-of-00001"
    data.write_bytes(data.read_bytes()[:-4])
    with pytest.raises(WeightFileError, match="truncated"):
        load_model(folder)


def test_shapes_that_disagree(tmp_path):
    tensors = fixture_tensors()
    tensors["bilm/CNN_proj/W_proj"] = np.zeros((124, 17), np.float32)  # P = 17, the LSTM says 16
    folder = module_copy(tmp_path)
    write_bundle(folder / VARIABLES, tensors)
    with pytest.raises(WeightFileError, match=r"bilm/CNN_proj/b_proj has shape \[16\], but the other variables imply \[17\]"):
        load_model(folder)


def test_a_mix_of_another_layer_count_is_refused_naming_it(tmp_path):
    """aggregation/weights must hold one weight a layer of the biLM (3 here): 4 are refused."""
    tensors = fixture_tensors()
    tensors["aggregation/weights"] = np.zeros(4, np.float32)
    folder = module_copy(tmp_path)
    write_bundle(folder / VARIABLES, tensors)
    with pytest.raises(WeightFileError, match=r"aggregation/weights holds 4 weights, expected one a layer .*, 3"):
        hub.Module(str(folder))
    archive = tmp_path / "module.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname=".")
    with pytest.raises(WeightFileError, match=rf"^{re.escape(str(archive))} \(read from .*aggregation/weights holds 4"):
        hub.Module(str(archive))  # the archive the user gave, not only elmokit's cache folder
    tensors["aggregation/weights"] = np.zeros(3, np.float32)
    write_bundle(folder / VARIABLES, tensors)
    assert module_mix(folder) == ([0.0, 0.0, 0.0], pytest.approx(MIX_SCALING))


@pytest.mark.parametrize("kept", ["aggregation/weights", "aggregation/scaling"])
def test_half_a_mix_is_refused_naming_what_is_missing(tmp_path, kept):
    """A module with one of aggregation/weights and aggregation/scaling: refused (its `elmo`
    output would be another mix without a word), the other named."""
    tensors = {name: value for name, value in fixture_tensors().items()
               if not name.startswith("aggregation/") or name == kept}
    folder = module_copy(tmp_path)
    write_bundle(folder / VARIABLES, tensors)
    missing = ({"aggregation/weights", "aggregation/scaling"} - {kept}).pop()
    with pytest.raises(WeightFileError, match=rf"{re.escape(str(folder))}: the module has {kept} but no {missing}"):
        hub.Module(str(folder))


def test_absurd_sizes_are_refused_before_allocating(tmp_path):
    """An entry declaring 262 x 10^9 floats in a 420 KB data file: refused, nothing allocated."""
    tensors = fixture_tensors()
    folder = module_copy(tmp_path)
    write_bundle(folder / VARIABLES, tensors, entries={"bilm/char_embed": {"shape": (262, 10**9),
                                                                          "size": 262 * 10**9 * 4}})
    tracemalloc.start()
    with pytest.raises(WeightFileError):
        load_model(folder)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 50e6, peak
    write_bundle(folder / VARIABLES, tensors, entries={"bilm/CNN/W_cnn_0": {"size": 10**12}})
    with pytest.raises(WeightFileError, match="needs 64 bytes, its entry says 1,000,000,000,000"):
        load_model(folder)
    write_bundle(folder / VARIABLES, tensors, entries={"bilm/CNN/W_cnn_0": {"offset": 10**9}})
    with pytest.raises(WeightFileError, match="truncated"):
        load_model(folder)


def test_a_module_that_is_not_elmo_names_what_it_found(tmp_path):
    folder = module_copy(tmp_path)
    write_bundle(folder / VARIABLES, {"dense/kernel": np.ones((4, 2), np.float32), "dense/bias": np.zeros(2, np.float32)})
    with pytest.raises(WeightFileError, match=r"not an ELMo module: no bilm/char_embed among its 2 variables "
                                              r"\(dense/bias \[2\], dense/kernel \[4, 2\]\)"):
        load_model(folder)


def test_an_incomplete_module_folder_says_so(tmp_path):
    folder = module_copy(tmp_path)
    (folder / "variables" / "variables.index").unlink()
    with pytest.raises(FileNotFoundError, match="TensorFlow module folder without its variables"):
        load_model(folder)


def tar_with(tmp_path: Path, member: tarfile.TarInfo, data: bytes = b"") -> Path:
    path = tmp_path / "hostile.tar.gz"
    with tarfile.open(ARCHIVE) as source, tarfile.open(path, "w:gz") as tar:
        for original in source.getmembers():
            tar.addfile(original, source.extractfile(original) if original.isfile() else None)
        tar.addfile(member, io.BytesIO(data) if member.isfile() else None)
    return path


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink", "hardlink", "device"])
def test_hostile_archives_are_refused_before_writing(tmp_path, kind):
    member = tarfile.TarInfo({"dotdot": "../escaped.txt", "absolute": "/tmp/escaped.txt"}.get(kind, "variables/link"))
    if kind == "symlink":
        member.type, member.linkname = tarfile.SYMTYPE, "/etc/passwd"
    elif kind == "hardlink":
        member.type, member.linkname = tarfile.LNKTYPE, "saved_model.pb"
    elif kind == "device":
        member.type = tarfile.CHRTYPE
    else:
        member.size = 3
    archive = tar_with(tmp_path, member, b"bad")
    with pytest.raises(WeightFileError, match="outside the module folder|is a link|is not a file or folder"):
        load_model(archive)
    assert not (tmp_path / "escaped.txt").exists()
    assert not list((tmp_path / "elmokit-cache").rglob("variables.index"))  # nothing extracted


def test_an_archive_of_too_many_members_is_refused_before_writing(tmp_path):
    path = tmp_path / "many.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for i in range(1001):
            tar.addfile(tarfile.TarInfo(f"variables/part{i}"), io.BytesIO(b""))
    with pytest.raises(WeightFileError, match="more than 1000 members: not a TF-Hub module"):
        load_model(path)
    assert not list((tmp_path / "elmokit-cache").rglob("part0"))


def test_an_archive_past_the_cap_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("ELMOKIT_MAX_DOWNLOAD_GB", "0.0001")  # 100 KB: the module holds 500 KB
    with pytest.raises(WeightFileError, match="more than 100,000 bytes"):
        load_model(ARCHIVE)


def test_an_archive_extracts_once(tmp_path):
    first = load_tfhub_module(module_folder(str(ARCHIVE)))
    folders = list((tmp_path / "elmokit-cache" / "tfhub").iterdir())
    assert len(folders) == 1 and folders[0].name == hashlib.sha256(ARCHIVE.read_bytes()).hexdigest()
    assert module_folder(str(ARCHIVE)) == folders[0]
    assert not [p for p in folders[0].parent.iterdir() if p.name.endswith(".partial")]
    assert first.config.lstm.cell_dim == 64


def test_the_integrations_take_a_module_folder(reference):
    """LangChain's ELMoEmbeddings(model=FOLDER) gives the sentence vectors of the same weights
    loaded from the HDF5 file (the integrations load through load_model)."""
    pytest.importorskip("langchain_core", reason="the langchain extra: pip install 'elmokit[langchain]'")
    from elmokit.integrations.langchain import ELMoEmbeddings

    texts = ["The cat sat on the mat .", "Dogs bark ."]
    ours = ELMoEmbeddings(model=str(MODULE)).embed_documents(texts)
    theirs = ElmoEmbedder(module=reference).sentence_vectors([text.split() for text in texts])
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-5)


def test_training_starts_from_a_module_and_a_native_folder_error_points_to_load_model(tmp_path, reference):
    """`elmo train --init-from` takes a module folder or archive (its biLM, a new softmax);
    `load_pretrained` of a module folder names what reads it."""
    from elmokit.model.weights import load_pretrained
    from elmokit.training.build import build_model
    from elmokit.training.config import TrainConfig
    from elmokit.training.vocab import Vocabulary

    (tmp_path / "vocab.txt").write_text("<S>\n</S>\n<UNK>\nthe\ncat\n")
    vocab = Vocabulary.load(tmp_path / "vocab.txt")
    for given in (MODULE, ARCHIVE):
        model = build_model(TrainConfig(init_from=str(given), vocab=str(tmp_path / "vocab.txt")), vocab)
        assert_same_weights(model.bilm, reference)
        assert model.softmax.weight.shape[0] == len(vocab)
    with pytest.raises(FileNotFoundError, match=r"no config.json\); elmokit.load_model reads .* a TF-Hub module folder"):
        load_pretrained(MODULE)
    with pytest.raises(FileNotFoundError, match=r"--init-from small: no such folder or module archive; .* --to-native"):
        build_model(TrainConfig(init_from="small", vocab=str(tmp_path / "vocab.txt")), vocab)
    damaged = module_copy(tmp_path)
    (damaged / "variables" / "variables.index").unlink()
    with pytest.raises(FileNotFoundError, match="without its variables/variables.index"):  # load_model's own words
        build_model(TrainConfig(init_from=str(damaged), vocab=str(tmp_path / "vocab.txt")), vocab)
    builtin = build_model(TrainConfig(init_from="gutenberg-en", vocab=str(tmp_path / "vocab.txt")), vocab)
    assert builtin.bilm.config == load_model("gutenberg-en").config
