"""What a newcomer tripped on (issue 39 point 6): the built-in model's name in `elmo export`, a
task run that ends predicting one class, `elmo embed`'s rate on small runs, docstrings citing a
spec that is not in the repository."""

from __future__ import annotations

import re

from tests.conftest import REPO


def test_no_docstring_cites_the_spec_by_section_number():
    """The spec (../shared/spec) is not part of a clone: "spec §9" means nothing to a reader."""
    cited = [f"{path.relative_to(REPO)}:{number}" for path in sorted((REPO / "src").rglob("*.py"))
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"spec §|§\s*\d", line) and "Peters et al." not in line]
    assert not cited, f"say what is meant instead of the section number: {cited}"


def test_readme_names_every_package_the_page_test_needs():
    """The page's test skips unless Debian's chromium and its driver are installed: the README's
    line about it names both packages."""
    page_test = (REPO / "tests" / "test_serve_page.py").read_text(encoding="utf-8")
    packages = re.search(r"apt-get install -y ([\w\- ]+)", page_test).group(1).split()
    assert packages == ["chromium", "chromium-driver"]
    line = next(line for line in (REPO / "README.md").read_text(encoding="utf-8").splitlines() if "page's test" in line)
    assert all(f"`{name}`" in line or f" {name}" in line for name in packages), line
    assert "chromium-driver" in line


def test_export_takes_the_builtin_models_name(tmp_path, capsys):
    """`elmo export gutenberg-en` (or --model gutenberg-en) exports the built-in model, as every
    command takes that name; a published name is refused with what export takes instead."""
    from elmokit.cli import main
    from elmokit.model.builtin import builtin_model_dir

    assert main(["export", "--model", "gutenberg-en", "--native", str(tmp_path / "named"), "--no-softmax"]) == 0
    assert main(["export", str(builtin_model_dir()), "--native", str(tmp_path / "path"), "--no-softmax"]) == 0
    assert ((tmp_path / "named" / "model.safetensors").read_bytes()
            == (tmp_path / "path" / "model.safetensors").read_bytes())
    capsys.readouterr()
    assert main(["export", "original", "--native", str(tmp_path / "o")]) == 2
    error = capsys.readouterr().err
    assert "original: elmo export converts a model trained by elmokit" in error and "gutenberg-en" in error
    assert not (tmp_path / "o").exists()


def test_embed_summary_shows_a_rate_for_small_runs():
    from elmokit.inference.estimate import EmbedReport

    assert "(0.43 tokens/s)" in EmbedReport(2, 3, 7.0, 100, 200).summary()  # was "(0 tokens/s)"
    assert "(1,500 tokens/s)" in EmbedReport(10, 3000, 2.0, 100, 200).summary()
    assert "tokens/s" not in EmbedReport(1, 0, 0.5, 100, None).summary()  # no token, no rate


def test_single_class_warning_names_what_to_raise():
    from types import SimpleNamespace

    from elmokit.tasks.readers import LabelledSentence, TaggedSentence
    from elmokit.tasks.train import single_class_warning

    dev = [TaggedSentence(["mr", "smith", "came"], ["O", "B-PER", "O"]), TaggedSentence(["in", "york"], ["O", "B-LOC"])]
    train = [TaggedSentence(["a"], ["O"])] * 400
    data = SimpleNamespace(tagging=True, splits={"train": train, "dev": dev})
    config = SimpleNamespace(patience=3, lr=0.001)
    warning = single_class_warning(config, data, [["O"] * 3, ["O"] * 2], epochs=2, stopped_early=False)
    assert warning == ("warning: the model predicts 'O' for every dev token, though dev has 3 tags: it has not "
                       "learnt the task yet. Raise --max-epochs (it ran 2), the training sentences (400) or --lr (0.001)")
    assert "--patience" in single_class_warning(config, data, [["O"] * 3, ["O"] * 2], 5, stopped_early=True)
    assert single_class_warning(config, data, [["O", "B-PER", "O"], ["O"] * 2], 2, False) is None  # two classes
    one_class = SimpleNamespace(tagging=True, splits={"train": train, "dev": [TaggedSentence(["a"], ["O"])]})
    assert single_class_warning(config, one_class, [["O"]], 2, False) is None  # dev itself has one class
    labelled = SimpleNamespace(tagging=False, splits={"train": train, "dev": [LabelledSentence(["good"], 1),
                                                                            LabelledSentence(["bad"], 0)]})
    assert "predicts '1' for every dev sentence, though dev has 2 labels" in \
        single_class_warning(config, labelled, ["1", "1"], 1, False)


def test_a_run_that_learnt_one_class_says_so(tmp_path, capsys, caplog):
    """A 1-epoch classifier with a small learning rate ends predicting one label (seeded): the run
    reports the warning; a run that learnt (test_tasks) does not."""
    import logging

    from elmokit.tasks.train import TaskData, train_task
    from tests.test_tasks import quick_config, synthetic_sentiment

    config = quick_config("sst2", tmp_path, False, max_epochs=1, lr=0.001)
    splits = {"train": synthetic_sentiment(40, 0), "dev": synthetic_sentiment(20, 1)}
    with caplog.at_level(logging.INFO, logger="elmokit"):
        results = train_task(config, None, TaskData(config, splits, None))
    said = capsys.readouterr().err + caplog.text
    assert "warning: the model predicts" in said and "Raise --max-epochs (it ran 1)" in said
    assert results["dev"]["accuracy"] < 70  # what the warning is about
