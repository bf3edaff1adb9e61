"""Progress and messages (elmokit.progress, `elmo -v/-q`, `--no-progress`), `elmo embed`'s size
estimate, limit and report, and the one --device default of the command line."""

from __future__ import annotations

import io
import logging

import h5py
import pytest

from elmokit import progress
from elmokit.cli import build_parser, main
from elmokit.inference.estimate import InputScan, estimate_output_bytes
from elmokit.inference.files import EmbedOptions, scan_input
from elmokit.progress import LogProgress, RateEstimate, TerminalBar

BAR_CHARACTERS = ("█", "\r", "|")

TEXT = "\n".join(["the cat sat on the mat", "a dog barked", "", "colourless green ideas sleep furiously"] * 10) + "\n"


@pytest.fixture(autouse=True)
def restore_logging():
    """`main` configures the `elmokit` logger; put it back as a library user finds it."""
    logger = logging.getLogger("elmokit")
    yield
    logger.handlers = [h for h in logger.handlers if not isinstance(h, progress.LogHandler)]
    logger.setLevel(logging.NOTSET)
    logger.propagate = True


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "in.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------
# The rate and the ETA leave the first (slow) update out
# ---------------------------------------------------------------------------------------------
def test_rate_leaves_out_the_first_update():
    estimate = RateEstimate()
    estimate.observe(64, now=30.0)  # the first batch: 30 s of loading and warm-up
    assert estimate.rate(64, 30.0) is None and estimate.seconds_left(64, 20_000, 30.0) is None
    estimate.observe(128, now=31.0)
    assert estimate.rate(128, 31.0) == pytest.approx(64.0)
    assert estimate.seconds_left(128, 20_000, 31.0) == pytest.approx((20_000 - 128) / 64)


def test_the_bar_eta_after_a_fake_slow_first_batch_is_sane():
    """20,000 sentences at 64 a second after a first batch of 30 s: about 5 minutes left, not
    the hours that a rate over the first batch gives (tqdm's own: 64 sentences in 30 s)."""
    clock = [0.0]
    bar = TerminalBar(total=20_000, unit="sent", file=io.StringIO(), mininterval=0, smoothing=0.3)
    bar._time = lambda: clock[0]
    bar.start_t = bar.last_print_t = 0.0
    clock[0] = 30.0
    bar.update(64)
    assert "<?" in str(bar)  # no rate yet: no estimate rather than a wrong one
    for second in range(31, 36):
        clock[0] = float(second)
        bar.update(64)
    seconds_left = (20_000 - 6 * 64) / 64  # 306 s
    assert f"<{bar.format_interval(seconds_left)}" in str(bar), str(bar)
    bar.close()


def test_log_lines_every_interval_with_rate_and_time_left():
    clock = [0.0]
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("elmokit.progress").addHandler(handler)
    logging.getLogger("elmokit.progress").setLevel(logging.INFO)
    try:
        bar = LogProgress(total=1000, desc="scoring", unit="tokens", interval=10, clock=lambda: clock[0])
        for second in (20, 21, 25, 32, 45):  # the first update is a slow warm-up
            clock[0] = float(second)
            bar.update(100)
        bar.close()
    finally:
        logging.getLogger("elmokit.progress").removeHandler(handler)
        logging.getLogger("elmokit.progress").setLevel(logging.NOTSET)
    assert lines[0] == "scoring: 100/1,000 tokens (10%), ? left"  # at 20 s: no rate yet
    assert lines[1] == "scoring: 400/1,000 tokens (40%), 25 tokens/s, 24s left"  # at 32 s: 300 in 12 s
    assert lines[2] == "scoring: 500/1,000 tokens (50%), 16 tokens/s, 31s left"  # at 45 s: 400 in 25 s
    assert lines[3] == "scoring: 500 tokens in 45s (11.11 tokens/s)" and len(lines) == 4  # the whole run


# ---------------------------------------------------------------------------------------------
# What `elmo embed` prints: log lines in a file, a bar on a terminal, nothing but errors with -q
# ---------------------------------------------------------------------------------------------
def test_embed_in_a_log_file_prints_periodic_lines_and_no_bar(model_dir, text_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ELMOKIT_PROGRESS_INTERVAL", "0")  # a line at every update
    out = tmp_path / "out.hdf5"
    assert main(["embed", str(text_file), str(out), "--model", str(model_dir), "--batch-size", "2"]) == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert not any(character in captured.err for character in BAR_CHARACTERS), captured.err
    assert lines[0].startswith(f"embedding {text_file} into {out}: 40 sentences, 140 tokens;")
    assert "about" in lines[0] and "to write" in lines[0]
    assert any(line.startswith("embedding: 140/140 tokens (100%)") for line in lines), lines
    assert lines[-1].startswith(f"wrote {out}: 40 sentences, 140 tokens in ")
    assert "tokens/s); " in lines[-1] and "written (estimated" in lines[-1]


def test_embed_on_a_terminal_draws_a_bar(model_dir, text_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(progress, "stderr_is_terminal", lambda: True)
    assert main(["embed", str(text_file), str(tmp_path / "out.hdf5"), "--model", str(model_dir)]) == 0
    err = capsys.readouterr().err
    assert "embedding: 100%|" in err and "█" in err
    assert "writing out.hdf5" not in err  # the merge of a short run is too quick for a bar of its own


@pytest.mark.parametrize("where", ["before", "after"])
def test_quiet_prints_nothing_but_errors(model_dir, text_file, tmp_path, capsys, monkeypatch, where):
    monkeypatch.setenv("ELMOKIT_PROGRESS_INTERVAL", "0")
    monkeypatch.setattr(progress, "stderr_is_terminal", lambda: True)  # not even a bar on a terminal
    embed = ["embed", str(text_file), str(tmp_path / "out.hdf5"), "--model", str(model_dir)]
    argv = ["-q", *embed] if where == "before" else [*embed, "-q"]
    assert main(argv) == 0
    assert capsys.readouterr() == ("", "")
    assert main(argv) == 2  # the output exists now: an error, which -q still prints
    err = capsys.readouterr().err
    assert err.startswith("elmo embed: error:") and "--overwrite" in err


def test_no_progress_keeps_the_messages_but_no_progress(model_dir, text_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ELMOKIT_PROGRESS_INTERVAL", "0")
    assert main(["embed", str(text_file), str(tmp_path / "out.hdf5"), "--model", str(model_dir),
                 "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "embedding:" not in err and "wrote" in err


# ---------------------------------------------------------------------------------------------
# The size: estimated before, refused above --max-output-gb, reported after
# ---------------------------------------------------------------------------------------------
def test_embed_refuses_an_output_above_the_limit_and_names_the_flag(model_dir, text_file, tmp_path, capsys):
    out = tmp_path / "out.hdf5"
    assert main(["embed", str(text_file), str(out), "--model", str(model_dir), "--max-output-gb", "0.00001"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("elmo embed: error:") and "\n" not in err
    assert "above --max-output-gb 1e-05" in err and "pass --max-output-gb" in err and "--top" in err
    assert not out.exists() and not (tmp_path / "out.hdf5.partial").exists()
    needed = float(err.split("pass --max-output-gb ")[1].split()[0])
    assert main(["embed", str(text_file), str(out), "--model", str(model_dir), "--max-output-gb", str(needed)]) == 0
    assert out.stat().st_size <= needed * 1e9


@pytest.mark.parametrize("output_format, sentence_vectors, file_format",
                         [("all", False, "hdf5"), ("top", False, "npz"), ("average", True, "hdf5")])
def test_the_size_estimate_is_close(model_dir, tiny_model, tmp_path, output_format, sentence_vectors, file_format):
    lines = [" ".join(f"w{(i * 7 + j) % 50}" for j in range(5 + i % 30)) for i in range(300)]
    source = tmp_path / "in.txt"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / f"out.{file_format}"
    assert main(["embed", str(source), str(out), "--model", str(model_dir), f"--{output_format}", "-q",
                 "--format", file_format, *(["--sentence-vectors"] if sentence_vectors else [])]) == 0
    options = EmbedOptions(output_format=output_format, file_format=file_format, sentence_vectors=sentence_vectors)
    estimate = estimate_output_bytes(scan_input(source, False), tiny_model.config.n_output_layers,
                                     tiny_model.config.output_dim, options)
    assert estimate == pytest.approx(out.stat().st_size, rel=0.15)


def test_the_estimate_counts_tokens_as_the_run_tokenizes(tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("Hello, world!\n\nIt's fine.\n", encoding="utf-8")
    assert list(scan_input(source, False).line_tokens) == [2, 0, 2]
    moses = scan_input(source, False, tokenize=lambda line: line.replace(",", " ,").replace("!", " !").split())
    assert list(moses.line_tokens) == [4, 0, 2]
    scan = InputScan(3, moses.line_tokens, 30)
    assert scan.n_tokens == 6 and scan.tokens_of(range(0, 3, 2)) == 6 and scan.tokens_of(range(1, 3, 2)) == 0


def test_embed_a_resumed_run_reports_only_its_own_work(model_dir, text_file, tmp_path, capsys):
    """The report counts what this run embedded, read back from the file's arrays."""
    out = tmp_path / "out.hdf5"
    assert main(["embed", str(text_file), str(out), "--model", str(model_dir), "--top"]) == 0
    with h5py.File(out) as written:
        tokens = sum(written[str(i)].shape[0] for i in range(40))
    assert f"40 sentences, {tokens} tokens" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# One CLI: one --device default, said in every --help; the library's errors speak Python
# ---------------------------------------------------------------------------------------------
DEVICE_COMMANDS = [["embed"], ["similar"], ["perplexity"], ["train"], ["task", "train"], ["task", "eval"],
                   ["task", "predict"]]


@pytest.mark.parametrize("command", DEVICE_COMMANDS, ids=" ".join)
def test_every_device_option_defaults_to_auto_and_says_so(command, capsys):
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--device" in text
    assert "default: auto" in text or "(default: 'auto')" in text or "(default auto)" in text, text


def test_commands_without_a_device_run_on_auto_or_elmokit_device(monkeypatch, tmp_path):
    import torch

    from elmokit.commands.common import DEFAULT_DEVICE, default_device, device_from_args
    from elmokit.commands.train import config_from_args

    monkeypatch.delenv("ELMOKIT_DEVICE", raising=False)  # conftest pins the tests to the CPU
    args = build_parser().parse_args(["embed", "in.txt", "out.hdf5"])
    assert args.device is None and DEFAULT_DEVICE == "auto"
    assert device_from_args(args).type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert default_device() == "auto"  # what task train, eval and predict take when --device is absent
    assert config_from_args(build_parser().parse_args(["train"])).device == "auto"

    monkeypatch.setenv("ELMOKIT_DEVICE", "cpu")
    assert device_from_args(build_parser().parse_args(["embed", "in.txt", "out.hdf5"])) == torch.device("cpu")
    assert default_device() == "cpu"
    assert config_from_args(build_parser().parse_args(["train"])).device == "cpu"
    assert config_from_args(build_parser().parse_args(["train", "--device", "auto"])).device == "auto"
    saved = tmp_path / "train.json"
    saved.write_text('{"device": "cuda"}')
    assert config_from_args(build_parser().parse_args(["train", "--config", str(saved)])).device == "cuda"

    monkeypatch.setenv("ELMOKIT_DEVICE", "gpu")
    with pytest.raises(ValueError, match="ELMOKIT_DEVICE must be"):
        device_from_args(build_parser().parse_args(["embed", "in.txt", "out.hdf5"]))
    assert main(["info"]) == 0  # a bad ELMOKIT_DEVICE stops only the commands that run on a device


def test_a_missing_gpu_is_a_python_error_in_python_and_a_flag_on_the_command_line(monkeypatch):
    import torch

    from elmokit.commands.common import device_or_advice
    from elmokit.devices import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError) as python_error:
        resolve_device("cuda")
    assert "device='cpu'" in str(python_error.value) and "--" not in str(python_error.value)
    with pytest.raises(ValueError) as cli_error:
        device_or_advice("cuda")
    assert "torch sees no CUDA GPU" in str(cli_error.value) and "--device cpu" in str(cli_error.value)
    assert "device='cpu'" not in str(cli_error.value)


def test_library_errors_say_python_and_the_command_line_says_flags(model_dir, text_file, tmp_path, capsys):
    from elmokit.inference.files import embed_file
    from elmokit.inference.embedder import ElmoEmbedder
    from elmokit.training.corpus import prepare_corpus
    from elmokit.textfiles import CorpusError

    prepare_corpus([text_file], tmp_path / "shards", progress=False)
    with pytest.raises(CorpusError) as python_error:
        prepare_corpus([text_file], tmp_path / "shards", progress=False)
    assert "overwrite=True" in str(python_error.value) and "--" not in str(python_error.value)
    assert main(["prepare", str(text_file), "-o", str(tmp_path / "shards"), "--pretokenized"]) == 2
    err = capsys.readouterr().err
    assert "pass --overwrite to replace them" in err and "overwrite=True" not in err

    partial = tmp_path / "out.hdf5.partial"
    partial.mkdir()
    (partial / "progress-rank0.json").write_text("{}")
    embedder = ElmoEmbedder(str(model_dir))
    with pytest.raises(FileExistsError, match=r"continue it with resume=True, or pass overwrite=True"):
        embed_file(embedder, text_file, tmp_path / "out.hdf5", overwrite=False)
    assert main(["embed", str(text_file), str(tmp_path / "out.hdf5"), "--model", str(model_dir)]) == 2
    assert "continue it with --resume, or pass --overwrite" in capsys.readouterr().err


def test_verbose_adds_debugging_detail(model_dir, text_file, tmp_path, capsys):
    assert main(["embed", str(text_file), str(tmp_path / "out.hdf5"), "--model", str(model_dir), "-v"]) == 0
    err = capsys.readouterr().err
    assert "elmo embed: debug: elmokit " in err and "embedding: a progress line every 30 s" in err
    assert main(["embed", str(text_file), str(tmp_path / "out.hdf5"), "--model", str(model_dir), "--overwrite"]) == 0
    assert ": debug: " not in capsys.readouterr().err


def test_verbose_and_quiet_together_is_an_error(capsys):
    assert main(["-v", "info", "-q"]) == 2
    assert "not both" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Training and scoring report their progress with a total
# ---------------------------------------------------------------------------------------------
def test_train_and_perplexity_report_progress_with_a_total(tmp_path, capsys, monkeypatch):
    from elmokit.training.corpus import count_targets
    from tests.test_devices import write_lm_inputs

    monkeypatch.setenv("ELMOKIT_PROGRESS_INTERVAL", "0")
    write_lm_inputs(tmp_path)
    run = tmp_path / "run"
    epoch_targets = count_targets([tmp_path / "train.txt"])
    valid_targets = count_targets([tmp_path / "valid.txt"])
    capsys.readouterr()
    assert main(["train", "--train", str(tmp_path / "train.txt"), "--valid", str(tmp_path / "valid.txt"),
                 "--vocab", str(tmp_path / "vocab.txt"), "--model", str(tmp_path / "model.json"),
                 "--output-dir", str(run), "--batch-size", "4", "--unroll-steps", "5", "--epochs", "2",
                 "--n-samples", "10", "--threads", "1", "--device", "cpu", "--log-every", "1"]) == 0
    err = capsys.readouterr().err
    assert not any(character in err for character in BAR_CHARACTERS), err
    lines = err.splitlines()
    assert any(line.startswith("training: ") and f"/{2 * epoch_targets:,} tokens (" in line for line in lines), err
    assert any(line.startswith("training: ") and " left, step " in line for line in lines), err  # ETA, then the step
    assert any(line.startswith("validation at step ") and f"/{valid_targets} tokens (100%)" in line for line in lines)
    assert any(line.startswith("step ") and "valid perplexity" in line for line in lines)
    assert main(["perplexity", str(run), str(tmp_path / "valid.txt"), "--json", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert f"scoring: {valid_targets}/{valid_targets} tokens (100%)" in captured.err
    assert "ppl" in captured.out


def test_count_targets_is_words_and_one_per_sentence(tmp_path):
    from elmokit.training.corpus import count_targets

    (tmp_path / "a.txt").write_text("a b c\nd\ne f\n", encoding="utf-8")
    assert count_targets([tmp_path / "a.txt"]) == (3 + 1) + (1 + 1) + (2 + 1)
    assert count_targets([tmp_path / "a.txt"], max_sentences=2) == (3 + 1) + (1 + 1)


def test_reprs_say_what_the_object_is(tiny_model):
    from elmokit.inference.cache import TokenCache

    lstm = tiny_model.config.lstm
    first_lines = repr(tiny_model).splitlines()[:2]
    assert first_lines[0] == "BiLM(" and first_lines[1].strip().startswith(
        f"{lstm.n_layers} x {lstm.cell_dim} cells -> {lstm.projection_dim}, {tiny_model.config.n_output_layers} layers")
    cache = TokenCache(tiny_model)
    cache.rows(["a", "b", "a"])
    assert repr(cache) == f"TokenCache(2 of {cache.max_size:,} words, {lstm.projection_dim} floats each, device=cpu)"
    assert repr(tiny_model.config).startswith("ElmoConfig(") and "lstm=LSTMConfig(" in repr(tiny_model.config)
