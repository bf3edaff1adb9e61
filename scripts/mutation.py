"""Mutation testing: change one line of the library at a time and run the tests that should notice;
a mutant they do not fail on "survived" (issue 32, point 3; issue 38, point 6).

    .venv/bin/python scripts/mutation.py                      # every mutant -> bench/results/mutation.md
    .venv/bin/python scripts/mutation.py --only serve --output /tmp/mutation.md
    .venv/bin/python scripts/mutation.py --check              # only: does every mutant still match the code?

Each mutant is one exact text replacement in one file of src/elmokit, which must occur exactly once
there: a mutant whose text no longer occurs once (the line changed) fails the run before anything
runs, naming it, so the page never reports mutants that were not applied.

The mutants run in a copy of the repository (its tracked and untracked-but-not-ignored files, made
in a temporary folder), never in the working tree, so other work in the tree never sees a mutated
file. The copy has no ../shared beside it, as a fresh clone, and its tests run with CI=true, so that
a golden test (bilm-tf's numbers, tests/fixtures/elmo-fixture) that skips fails instead of passing
unnoticed. The copy's src/ comes first on PYTHONPATH (checked: `elmokit` must import from the copy,
not from an editable install of another tree). First the covering tests run unmutated: a mutant
whose tests fail then is not run (it could only look killed) and fails the run. A mutant is killed
when its tests fail (pytest's exit status 1, `-x`: the first failure ends the run); any other status
is reported as it is. `--jobs N` runs N mutants at once, each in its own copy.

A mutant that survives either gets a test that kills it, or an argument on the page that it is
equivalent (`Mutant.equivalent`: why no correct test can tell it from the library). The script
prints the survivors and exits 1 if any survives without such an argument (or was not run).
tests/test_mutation_script.py checks that every mutant still matches the code and that the page is
this script's for exactly these mutants.
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "bench" / "results" / "mutation.md"


@dataclass(frozen=True)
class Mutant:
    name: str  # what the mutant changes, in words (unique)
    path: str  # under src/elmokit
    old: str  # occurs exactly once in the file
    new: str
    tests: tuple[str, ...]  # test files or node ids that should kill it, the likeliest first (-x)
    equivalent: str = ""  # where it survives: why no correct test can tell it from the library


CELL_TESTS = ("tests/test_cell.py", "tests/test_fixture.py")
SERVE_RECURRENCE = "tests/test_serve_trust.py::test_the_serve_recurrence_is_the_models_forward_on_a_3_layer_model_whose_clips_differ"
SERVE_LIMITS = "tests/test_serve_trust.py::test_each_limit_admits_exactly_its_value_and_refuses_one_more"
STREAMS = ("tests/test_model.py::test_sentences_streamed_through_rows_match_one_at_a_time",
           "tests/test_elmo.py::test_embed_many_matches_sentence_by_sentence")
SERVE_COMPACT = "tests/test_serve.py::test_compacting_the_recurrence_moves_sentences_down_without_changing_their_vectors"
SERVE_VECTORS = "tests/test_serve_trust.py::test_the_served_sentence_vector_is_the_one_definition_of_it"
ONNX_CLIPPED = "tests/test_onnx.py::test_differing_clips_and_three_layers_match_elmokit"
DOWNLOADS = "tests/test_download_trust.py::"
MANYLANGS_NUMBERS = "tests/test_manylangs.py::test_their_numbers_through_elmo_embedder"
TFHUB = "tests/test_tfhub_module.py::"
FUSED_CELL = ("tests/test_fused_cell.py",)
MUTANTS = [
    # threads (devices.py): what other processes keep busy
    Mutant("threads: the window's CPU time of other processes ignored", "devices.py",
           "return max(0.0, statistics.median(now), window)", "return max(0.0, statistics.median(now))",
           ("tests/test_threads.py",)),
    Mutant("threads: this process's own CPU time counted as others'", "devices.py",
           "others = (after[0] - before[0]) - (after[1] - before[1])", "others = after[0] - before[0]",
           ("tests/test_threads.py",)),
    # the cell (model/cell.py): every driver runs these lines
    Mutant("cell: forget and input gates swapped", "model/cell.py",
           "torch.mul(forget_gate, cell_prev, out=cell_next).addcmul_(input_gate, candidate)",
           "torch.mul(input_gate, cell_prev, out=cell_next).addcmul_(forget_gate, candidate)", CELL_TESTS),
    Mutant("cell: cell clip removed", "model/cell.py", "    clip_(cell, cell_clip)\n", "\n", CELL_TESTS),
    Mutant("cell: every clip twice as wide", "model/cell.py", "values.clamp_(-limit, limit) if limit",
           "values.clamp_(-2 * limit, 2 * limit) if limit", CELL_TESTS),
    Mutant("cell: forget-gate offset 0", "model/cell.py", "FORGET_BIAS = 1.0", "FORGET_BIAS = 0.0", CELL_TESTS),
    Mutant("cell: m = o * c (no tanh)", "model/cell.py",
           "tanh_of_cell = tanh(cell, out=tanh_cell if tanh_cell is not None else cell_output)",
           "tanh_of_cell = cell", CELL_TESTS),
    # the fused cell (model/fused_cell.py, csrc/lstm_cell.cpp): the engine's and the server's step
    Mutant("fused cell: its cell clip removed (inference's and training's)", "csrc/lstm_cell.cpp",
           "return value < low ? low : (value > high ? high : value);", "return value;", FUSED_CELL),
    Mutant("fused cell: int8's recurrent row scale dropped", "csrc/lstm_cell.cpp",
           "                          * recurrent_row_scale[row];", ";", FUSED_CELL),
    Mutant("fused cell (training): the gradient passes where the cell was clipped", "csrc/lstm_cell.cpp",
           "dc = (next[c] < limit && next[c] > -limit) ? dc : 0.0f;", "dc = (next[c] < limit || true) ? dc : 0.0f;",
           FUSED_CELL),
    Mutant("fused cell (training): the forget gate's gradient without c_{t-1}", "csrc/lstm_cell.cpp",
           "const float forget_grad = (forget_gate - forget_gate * forget_gate) * previous[c] * dc;",
           "const float forget_grad = (forget_gate - forget_gate * forget_gate) * dc;", FUSED_CELL),
    Mutant("fused cell (training): buffers wider than their width taken", "model/fused_cell.py",
           "t.dtype in dtypes and t.shape == (n_dirs, rows, width * cell_dim)",
           "t.dtype in dtypes and t.shape[:2] == (n_dirs, rows) and t.shape[2] >= width * cell_dim", FUSED_CELL),
    Mutant("fused cell (training): --lstm-bf16's recurrent product not added to G_t", "csrc/lstm_cell.cpp",
           "               + bf16_to_float(recurrent[row * recurrent_stride + column]);", "               + 0.0f;",
           FUSED_CELL),
    Mutant("fused cell (training): --lstm-bf16's bias not added to G_t", "csrc/lstm_cell.cpp",
           "return (bias[column] + bf16_to_float(", "return (0.0f + bf16_to_float(", FUSED_CELL),
    Mutant("fused cell (training): the forget gate's gradient left out of the bias' gradient", "csrc/lstm_cell.cpp",
           "                bias[cell_dim + c] += forget_grad;\n", "", FUSED_CELL),
    Mutant("training softmax pass: the target's gradient without its -1", "csrc/lstm_cell.cpp",
           "const float gradient = k == target ? probability - 1.0f : probability;",
           "const float gradient = probability;", FUSED_CELL),
    Mutant("training softmax pass: the bias gradient replaces what its buffer held", "csrc/lstm_cell.cpp",
           "bias_grad[k] += partials[int64_t(thread) * width + k];",
           "bias_grad[k] = partials[int64_t(thread) * width + k];", FUSED_CELL),
    Mutant("training softmax pass: targets past the vocabulary taken", "model/fused_cell.py",
           "0 <= int(targets.min()) <= int(targets.max()) < logits.shape[1]",
           "0 <= int(targets.min()) <= int(targets.max()) <= logits.shape[1]", FUSED_CELL),
    Mutant("fused cell: loaded without its self-check", "model/fused_cell.py",
           "                problem = _self_check(library)", "                problem = \"\"", FUSED_CELL),
    Mutant("fused cell: a cell of any layout taken", "model/fused_cell.py",
           "cell.dim() == 2 and cell.is_contiguous()\n", "cell.dim() == 2\n", FUSED_CELL),
    Mutant("fused cell: gates of another width taken", "model/fused_cell.py",
           " and gates.shape == (rows, 4 * cell_dim)\n", "\n", FUSED_CELL),
    Mutant("fused cell: the engine's gate inputs not added to the recurrent product", "csrc/lstm_cell.cpp",
           "return to_float(product[row * product_stride + column]) + to_float(addend[row * addend_stride + column]);",
           "return to_float(product[row * product_stride + column]);", FUSED_CELL),
    Mutant("fused cell: the gate inputs read with the product's row stride", "csrc/lstm_cell.cpp",
           "to_float(addend[row * addend_stride + column])", "to_float(addend[row * product_stride + column])",
           FUSED_CELL),
    Mutant("fused cell: an addend of another dtype taken", "model/fused_cell.py",
           "(addend.dtype == gates.dtype and _gate_rows(", "(_gate_rows(", FUSED_CELL),
    Mutant("max over windows: the last window skipped", "csrc/lstm_cell.cpp",
           "for (int64_t window = 1; window < windows; ++window) {",
           "for (int64_t window = 1; window + 1 < windows; ++window) {", FUSED_CELL),
    Mutant("max over windows: NaN not propagated", "csrc/lstm_cell.cpp",
           "                nan[c] |= value != value;\n", "", FUSED_CELL),
    Mutant("fused passes: run while torch traces (the ONNX export)", "model/fused_cell.py",
           "    return torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()",
           "    return False", ("tests/test_onnx.py",)),
    Mutant("highway pass: relu left out", "csrc/lstm_cell.cpp",
           "const float relu = transform < 0.0f ? 0.0f : transform;", "const float relu = transform;", FUSED_CELL),
    Mutant("highway pass: the bfloat16 operand of the next product not written", "csrc/lstm_cell.cpp",
           "if constexpr (kNarrow) rounded[c] = float_to_bf16(value);", "", FUSED_CELL),
    Mutant("highway: the next layer's product reads the first layer's input", "model/encoder.py",
           "            x, operand = gated\n", "            x, _ = gated\n",
           ("tests/test_fused_cell.py::test_the_highway_pass_is_the_highway_layer",)),
    Mutant("fused cell: int8 row scales of any size taken", "model/fused_cell.py",
           "(row_scales, torch.float32, rows)]", "(row_scales, torch.float32, row_scales.numel())]", FUSED_CELL),
    Mutant("fused cell: oneDNN's int8 product scaled by the weight twice", "model/int8.py",
           "1.0, 0, torch.float32, \"none\", [], \"\"), scale, None", "1.0, 0, torch.float32, \"none\", [], \"\"), scale, "
           "self.weight_scale", FUSED_CELL),
    Mutant("engine: the projection reads the eager cell's buffer after the fused cell", "inference/engine.py",
           "            output[index] = self.projections[d](projection_input)  # (R, P)",
           "            output[index] = self.projections[d](state.cell_output[d].to(self.projections[d].dtype))",
           ("tests/test_fused_cell.py::test_the_embedder_gives_the_eager_numbers",)),
    Mutant("cell: the doubled candidate's tanh off by a half", "model/cell.py",
           "cell_dim, cell_dim).mul_(2).sub_(1)\n", "cell_dim, cell_dim).mul_(2).sub_(0.5)\n", CELL_TESTS),
    Mutant("stack: residual adds the undropped input", "model/cell.py",
           "output = output + dropped  # residual", "output = output + layer_input  # residual", CELL_TESTS),
    Mutant("stack: no residual on layer 2", "model/cell.py", "        if index > 0:\n", "        if index > 1:\n",
           CELL_TESTS),
    Mutant("stack: dropout on layer 0 only", "model/cell.py",
           "if dropout and training else layer_input", "if dropout and training and index == 0 else layer_input",
           CELL_TESTS),
    # the inference engine (inference/engine.py): what it passes to the cell, and its streams' resets
    Mutant("engine: projection clip removed", "inference/engine.py",
           "hidden = lstm_cell.clip_(output[group], proj_clip)", "hidden = output[group]", CELL_TESTS),
    Mutant("engine: cell clip removed", "inference/engine.py",
           "lstm_cell.cell_step(lstm_cell.activate_doubled_gates_(gates), state.cell[d], cell_clip,",
           "lstm_cell.cell_step(lstm_cell.activate_doubled_gates_(gates), state.cell[d], 0.0,", CELL_TESTS),
    Mutant("engine: the candidate's bias not doubled", "inference/engine.py",
           "bias = (layer.gate_bias().to(inputs.dtype) * candidate_doubled(layer).to(inputs.dtype)",
           "bias = (layer.gate_bias().to(inputs.dtype)", CELL_TESTS),
    Mutant("engine, bfloat16: the gates summed in bfloat16, not widened to float32", "inference/engine.py",
           "    return wide.copy_(product).add_(gate_inputs)", "    return product.add_(gate_inputs)",
           ("tests/test_cell.py::test_stream_engine_in_bfloat16_rounds_the_products_and_keeps_the_cell_in_float32",
            "tests/test_precision.py")),
    Mutant("engine: the fused cell given no gate inputs", "inference/engine.py",
           "addend=gate_inputs[d][offset])", "addend=None)", CELL_TESTS),
    Mutant("engine reset: the hidden state carried into the next sentence of a row", "inference/engine.py",
           "hidden = hidden * keep[offset]  # not in place", "hidden = hidden  # not in place", STREAMS),
    Mutant("engine reset: the cell state carried into the next sentence of a row", "inference/engine.py",
           "cell.mul_(keep[offset])", "cell.mul_(1.0)", STREAMS),
    Mutant("engine reset: no step marked as a sentence's start", "inference/streams.py",
           "torch.from_numpy(starts), starts.any(axis=1).tolist())",
           "torch.from_numpy(starts), [False] * len(starts))", STREAMS),
    Mutant("training: a fused optimizer asked for on CUDA (torch 2.11's Adagrad refuses it)", "training/build.py",
           '\n    if device.type != "cpu":\n        return False', "",
           ("tests/test_optimizers.py::test_fused_optimizers_only_on_the_cpu",)),
    Mutant("training: a part-empty window's gradient normalised by its targets, not its positions",
           "training/loop.py", "(summed / positions * dist_.world_size).backward()",
           "(loss * dist_.world_size).backward()",
           ("tests/test_recipe.py::test_a_part_empty_window_steps_in_proportion_to_its_targets",)),
    # issue 54: what a run writes, and what it resumes from
    Mutant("training: under --auto-resume each rank trusts its own view of the checkpoint", "training/loop.py",
           "found = dist_.gather((out_dir / ckpt.CHECKPOINT_NAME).is_file())[0]",
           "found = (out_dir / ckpt.CHECKPOINT_NAME).is_file()",
           ("tests/test_elastic.py::test_every_rank_follows_rank_0s_view_of_the_run_directory",)),
    Mutant("training: a NaN loss trained on", "training/loop.py",
           "if not (math.isfinite(result.loss) and math.isfinite(result.grad_norm)):", "if False:",
           ("tests/test_train.py::test_a_loss_gone_nan_stops_the_run_at_its_step_and_keeps_the_last_finite_checkpoint",)),
    Mutant("training: non-finite weights checkpointed", "training/checkpoint.py",
           "    if bad:\n        listed =", "    if False:\n        listed =",
           ("tests/test_train.py::test_weights_gone_infinite_after_a_finite_loss_are_never_checkpointed",)),
    Mutant("checkpoint: the zip members' CRC-32 not checked", "training/checkpoint.py",
           "    check_crcs(path)\n", "",
           ("tests/test_train.py::test_a_resume_refuses_a_damaged_or_non_finite_checkpoint",)),
    Mutant("checkpoint: a NaN weight resumed", "training/checkpoint.py",
           """check_finite(path, f"the model's tensor {name!r}", tensor)""", "pass",
           ("tests/test_train.py::test_a_resume_refuses_a_damaged_or_non_finite_checkpoint",)),
    Mutant("training: the run's files saved as given, relative to the folder it started in", "training/loop.py",
           "    config = config.with_absolute_paths()  # its saved", "    config = config  # its saved",
           ("tests/test_train.py::test_the_python_api_saves_a_runs_files_absolute_too",)),
    Mutant("training: a resume's paths compared as spelt (a run saved with relative ones refused)", "training/loop.py",
           "if name in PATH_FIELDS and _same_paths(old, value):", "if name == \"output_dir\" and _same_paths(old, value):",
           ("tests/test_train.py::test_a_run_started_with_relative_paths_resumes_from_another_folder",)),
    Mutant("training: a resumed data position's files compared as spelt", "training/data.py",
           "and same_files(saved, expected)):", "and False):",
           ("tests/test_train.py::test_a_run_started_with_relative_paths_resumes_from_another_folder",)),
    Mutant("training: the working folder's name read as a glob in the saved corpus paths", "training/config.py",
           "os.path.join(glob.escape(os.getcwd()), expanded)", "os.path.join(os.getcwd(), expanded)",
           ("tests/test_train.py::test_absolute_paths_keep_names_and_escape_the_folder_in_globs",)),
    Mutant("training: a preset model name made a path where a folder of that name exists", "training/config.py",
           "model=absolute(self.model) if self.model.endswith(\".json\") else self.model",
           "model=absolute(self.model) if os.path.exists(self.model) else self.model",
           ("tests/test_train.py::test_absolute_paths_keep_names_and_escape_the_folder_in_globs",)),
    Mutant("training: bfloat16 products by default on every CPU", "training/build.py",
           "native = device.type == \"cpu\" and bf16_native()", "native = device.type == \"cpu\"",
           ("tests/test_train_bf16.py::test_a_new_run_takes_bf16_products_where_the_cpu_has_native_bfloat16_and_a_resume_keeps_its_own",)),
    Mutant("training: a resume decides its products' precision again", "training/build.py",
           "    if resumed is not None:\n", "    if False:\n",
           ("tests/test_train_bf16.py::test_a_new_run_takes_bf16_products_where_the_cpu_has_native_bfloat16_and_a_resume_keeps_its_own",)),
    Mutant("training: the temporary files of killed writes kept", "training/loop.py",
           "ckpt.remove_unfinished_writes(written_files(out_dir))", "written_files(out_dir)",
           ("tests/test_elastic.py::test_auto_resume_starts_continues_and_replaces_an_unfinished_start",
            "tests/test_train.py::test_a_start_or_resume_removes_what_killed_writes_of_the_run_left")),
    Mutant("io: the umask read by setting it to 0 and back", "io.py",
           "with open(PROC_STATUS, encoding=", 'with open(PROC_STATUS + "-", encoding=',
           ("tests/test_io.py::test_the_umask_is_read_without_setting_it",)),
    Mutant("fork: children forked after a model load keep the parent's torch threads (spaCy's n_process hangs)",
           "sources/loading.py", "\n    one_thread_in_forked_children()\n", "\n",
           ("tests/test_integration_spacy.py::test_nlp_pipe_with_two_processes_finishes_and_gives_the_same_docs",)),
    # int8 inference (int8.py): the per-row scale, and what dtype="int8" marks
    Mutant("int8: the inputs' per-row scale dropped (oneDNN's quantized linear)", "model/int8.py",
           '"none", [], ""), scale', '"none", [], ""), torch.ones_like(scale)', ("tests/test_int8.py",)),
    Mutant("int8: the inputs' per-row scale dropped (torch._int_mm)", "model/int8.py",
           "return torch._int_mm(quantized, self.weight_t, out=sums), scale, self.weight_scale",
           "return torch._int_mm(quantized, self.weight_t, out=sums), torch.ones_like(scale), self.weight_scale",
           ("tests/test_int8.py",)),
    Mutant("int8: a block's input products timed as the whole call, not as the engine uses them", "model/int8.py",
           "partial(product.unscaled, x, sums) if scaled_later", "partial(product.unscaled, x, sums) if False",
           ("tests/test_int8.py::test_timing_calls_the_form_the_product_is_used_in",)),
    Mutant("int8: one kernel choice for a shape whatever its use", "model/int8.py",
           "key = (rows, *quantized.shape[::-1], scaled_later)", "key = (rows, *quantized.shape[::-1], False)",
           ("tests/test_int8.py::test_auto_takes_the_faster_kernel_timed_once_a_shape",)),
    Mutant("int8: oneDNN's block products scaled by the weight's scales a second time (eager cell)",
           "inference/engine.py", "Int8Linear.finish(products[offset], scale[offset], weight_scale, bias,",
           "Int8Linear.finish(products[offset], scale[offset], self.inputs[d].weight_scale, bias,",
           ("tests/test_int8.py::test_engine_takes_either_kernel_for_a_blocks_input_products",)),
    Mutant("int8: the engine's fused cell told oneDNN's block products are int32 sums", "inference/engine.py",
           "fused = fused_cell.cell_int8_((products[offset], scale[offset], weight_scale),",
           "fused = fused_cell.cell_int8_((products[offset], scale[offset], self.inputs[d].weight_scale),",
           ("tests/test_int8.py",)),
    Mutant("precision: a placement that changes a shared module's precision not said", "inference/elmo.py",
           "    if earlier == before != after:\n", "    if False:\n",
           ("tests/test_dtype_surfaces.py::test_a_placement_that_changes_a_shared_modules_precision_says_so",)),
    Mutant("int8: the token encoder's char CNN, highway and projection left in float32", "inference/elmo.py",
           "return [*bilm.lstm.layers, *(narrowed() if narrowed is not None else [])]", "return [*bilm.lstm.layers]",
           ("tests/test_int8.py::test_token_encoder_linears_run_in_bfloat16_under_int8",)),
    Mutant("int8: the char CNN's window products left in float32", "model/encoder.py",
           "if narrows(self):  # dtype=", "if False:  # dtype=",
           ("tests/test_int8.py::test_token_encoder_linears_run_in_bfloat16_under_int8",)),
    Mutant("int8: a stale bfloat16 weight kept after the weight changes", "model/int8.py",
           "if cached is None or cached[0] != key:", "if cached is None:",
           ("tests/test_int8.py::test_token_encoder_linears_run_in_bfloat16_under_int8",)),
    # copies made from the weights follow in-place edits (kernels.weights_key)
    Mutant("weights: an in-place edit not seen (no version in the key)", "kernels.py",
           "(tensor.data_ptr(), tensor._version, tensor.dtype, tensor.device)",
           "(tensor.data_ptr(), tensor.dtype, tensor.device)", ("tests/test_weight_edits.py",)),
    Mutant("weights: the token cache kept after the token encoder's weights change", "inference/cache.py",
           "if self._weights_key() != self.weights:", "if False:", ("tests/test_weight_edits.py",)),
    Mutant("ONNX: an int8-marked model exported with its marks", "inference/onnx_export.py",
           "    unquantize_modules(int8_modules(model))  #", "    pass  #",
           ("tests/test_onnx.py::test_a_model_placed_in_int8_exports_its_float32_weights",)),
    # the step loop and training's recurrence
    Mutant("step loop: projection clip removed", "model/lstm.py",
           "hidden = lstm_cell.clip_(torch.bmm(cell_output, projection), proj_clip)",
           "hidden = torch.bmm(cell_output, projection)", CELL_TESTS),
    Mutant("step loop: the cell clip is the projection's", "model/lstm.py",
           "self.cell_clip, self.proj_clip)\n            return output, (hidden, cell)",
           "self.proj_clip, self.proj_clip)\n            return output, (hidden, cell)", CELL_TESTS),
    Mutant("recurrence: the projection clipped with the cell clip", "training/recurrence.py",
           "proj_clip)  # h_t (D, B, P)", "cell_clip)  # h_t (D, B, P)", ("tests/test_cell.py", "tests/test_lm.py")),
    Mutant("recurrence: no forget-gate offset", "training/recurrence.py",
           "layer.recurrent_weight, layer.gate_bias(),", "layer.recurrent_weight, layer.bias,",
           ("tests/test_cell.py", "tests/test_lm.py")),
    Mutant("recurrence backward: the forget gate's factor without c_{t-1}", "training/recurrence.py",
           "out=slots[1]).mul_(cells[:, :-1])", "out=slots[1])", ("tests/test_lm.py",)),
    Mutant("recurrence backward: tanh's derivative 1 + tanh^2", "training/recurrence.py",
           "output_gate, through_tanh, value=-1,", "output_gate, through_tanh, value=1,", ("tests/test_lm.py",)),
    Mutant("recurrence forward: the CPU's default not the sigmoid form", "training/recurrence.py",
           'if acts.device.type == "cpu" if via_sigmoid is None else via_sigmoid:',
           'if acts.device.type == "cuda" if via_sigmoid is None else via_sigmoid:', ("tests/test_bench_fused.py",)),
    Mutant("recurrence forward: the candidate's pre-activation not doubled for its sigmoid", "training/recurrence.py",
           "torch.sigmoid(lstm_cell.double_candidate_(pre), out=out)", "torch.sigmoid(pre, out=out)",
           ("tests/test_lm.py",)),
    # the language model and its recipe
    Mutant("LM: no dropout before the softmax", "training/lm.py",
           "hidden = F.dropout(hidden, self.dropout, self.training)  # (D, B, U, P)", "pass",
           ("tests/test_cell.py",)),
    Mutant("sampler: n_tries off by one", "training/lm.py", "return draws[first], int(first[-1]) + 1",
           "return draws[first], int(first[-1])", ("tests/test_lm.py",)),
    Mutant("sampler: TF's P(k) K branch removed", "training/lm.py", "        if n_tries == n_samples:\n",
           "        if False:\n", ("tests/test_lm.py",)),
    Mutant("scoring softmax: the running sum not rescaled when the maximum grows", "training/softmax.py",
           "norm.mul_(torch.exp(top - new_top)).add_(", "norm.add_(", ("tests/test_softmax.py",)),
    Mutant("scoring softmax: the target's logit without its bias", "training/softmax.py",
           "\n                         + bias[targets].float())  # (N,)", ")  # (N,)", ("tests/test_softmax.py",)),
    Mutant("scoring softmax: the last slice of the vocabulary left out", "training/softmax.py",
           "for first in range(0, weight.shape[0], columns):",
           "for first in range(0, weight.shape[0] - columns + 1, columns):", ("tests/test_softmax.py",)),
    Mutant("softmax: the target's gradient -0.5 instead of -1", "training/softmax.py",
           "probabilities[row_index, targets] -= 1", "probabilities[row_index, targets] -= 0.5",
           ("tests/test_softmax.py",)),
    Mutant("softmax: --softmax-bf16's bias added in bfloat16", "training/softmax.py",
           "return linear(block.to(self.dtype), self.low_weight), self.bias",
           "return linear(block.to(self.dtype), self.low_weight, self.bias.to(self.dtype)), 0 * self.bias",
           ("tests/test_softmax.py",)),
    Mutant("softmax: --softmax-bf16's weight gradient from float32 operands", "training/softmax.py",
           "block_weight = matmul(low_grad.t(), low_block).to(grads[0].dtype)",
           "block_weight = matmul(grad_logits.t(), block).to(grads[0].dtype)", ("tests/test_softmax.py",)),
    Mutant("softmax: the full form's logsumexp without log p(top)", "training/softmax.py",
           "nll = top - target_logits - torch.log(probabilities.amax(dim=1))", "nll = top - target_logits",
           ("tests/test_softmax.py",)),
    Mutant("softmax: the full form's nll from the target's probability alone", "training/softmax.py",
           "nll = top - target_logits - torch.log(probabilities.amax(dim=1))",
           "nll = -torch.log(probabilities[row_index, targets])", ("tests/test_softmax.py",)),
    Mutant("optimizer: Adagrad's initial accumulator dropped", "training/build.py",
           "lr=config.lr, initial_accumulator_value=config.initial_accumulator,", "lr=config.lr,",
           ("tests/test_recipe.py",)),
    Mutant("optimizer: gradient clip loosened 10x", "training/loop.py",
           "clip_grad_norm_(parameters, config.grad_clip)", "clip_grad_norm_(parameters, 10 * config.grad_clip)",
           ("tests/test_recipe.py",)),
    Mutant("perplexity: the mean of the two perplexities", "training/loop.py",
           '"ppl": math.exp(0.5 * (forward + backward))', '"ppl": 0.5 * (math.exp(forward) + math.exp(backward))',
           ("tests/test_recipe.py",)),
    Mutant("init: relu filters normal", "model/bilm.py", 'if cnn.activation == "relu":', 'if cnn.activation == "x":',
           ("tests/test_recipe.py",)),
    Mutant("devices: torch.device('mps') accepted", "devices.py",
           'device.type not in ("cpu", "cuda")', 'device.type not in ("cpu", "cuda", "mps")',
           ("tests/test_recipe.py",)),
    Mutant("elastic: every restart attempt under one prefix of the agent's store", "training/processes.py",
           'dist.PrefixStore(f"elmokit/attempt_{attempt}", agent_store)', 'dist.PrefixStore("elmokit/attempt", agent_store)',
           ("tests/test_elastic.py::test_each_restart_attempt_keeps_its_keys_in_the_agents_store_apart",)),
    Mutant("elastic: the agent's shared store used unprefixed", "training/processes.py",
           'return {"store": dist.PrefixStore(f"elmokit/attempt_{attempt}", agent_store), "rank": rank,',
           'return {"store": agent_store, "rank": rank,',
           ("tests/test_elastic.py::test_each_restart_attempt_keeps_its_keys_in_the_agents_store_apart",)),
    Mutant("seeds: NumPy's generator not seeded", "training/processes.py", "    np.random.seed(seed)\n", "\n",
           ("tests/test_recipe.py",)),
    # what surrounds the LSTM
    Mutant("Elmo: no dropout", "inference/elmo.py", "representations.append(self.dropout(mixed)",
           "representations.append((mixed)", ("tests/test_cell.py",)),
    Mutant("chars: end-of-word written as begin-of-word", "model/chars.py",
           "ids[np.arange(n), kept + 1] = END_OF_WORD", "ids[np.arange(n), kept + 1] = BEGIN_OF_WORD",
           ("tests/test_chars.py", "tests/test_fixture.py")),
    Mutant("layer norm: unbiased variance", "model/mix.py", "variance = (((masked - mean) * mask) ** 2).sum() / count",
           "variance = (((masked - mean) * mask) ** 2).sum() / (count - 1)", ("tests/test_elmo.py", "tests/test_model.py")),
    Mutant("mix: weights not normalised", "model/mix.py", "torch.softmax(", "torch.sigmoid(",
           ("tests/test_model.py", "tests/test_elmo.py")),
    # the layer selection and the sentence vector (inference/layers.py: elmo embed, the embedder, hub)
    Mutant("sentence vector: the first token skipped", "inference/layers.py",
           "summed = values.sum(TOKEN_AXIS)  # (..., D)", "summed = values[..., 1:, :].sum(TOKEN_AXIS)  # (..., D)",
           ("tests/test_layers.py", "tests/test_embed_cli.py::test_layouts_hdf5_npz_and_sentence_vectors")),
    Mutant("layers: 'top' is the token layer", "inference/layers.py",
           "return layers[..., -1, :, :]", "return layers[..., 0, :, :]",
           ("tests/test_layers.py", "tests/test_embed_cli.py::test_layouts_hdf5_npz_and_sentence_vectors")),
    Mutant("engine: weights reordered again for a call of fewer rows", "inference/engine.py",
           "(not batched and cache[2] < rows)", "(not batched and cache[2] != rows)",
           ("tests/test_rows.py::test_weights_reordered_for_many_rows_serve_calls_of_fewer",)),
    Mutant("token cache: not started over when the module's precision changes", "inference/cache.py",
           "return bilm_precision(self.bilm), weights_key(", "return None, weights_key(",
           ("tests/test_dtype_surfaces.py",)),
    Mutant("elmo serve: a request larger than the whole queue admitted", "serve/batching.py",
           "if n_tokens > self.max_queue_tokens:", "if False:",
           ("tests/test_serve.py::test_at_the_defaults_the_largest_request_the_limits_admit_fits_the_queue",)),
    # elmo serve: its recurrence (serve/recurrence.py)
    Mutant("serve recurrence: no residual on layer 2", "serve/recurrence.py",
           "if index > 0:  # the residual", "if index > 1:  # the residual", (SERVE_RECURRENCE,)),
    Mutant("serve recurrence: the projection clipped with the cell clip", "serve/recurrence.py",
           "hidden = lstm_cell.clip_(view.hidden, self.proj_clip)",
           "hidden = lstm_cell.clip_(view.hidden, self.cell_clip)", (SERVE_RECURRENCE,)),
    Mutant("serve recurrence: cell clip removed", "serve/recurrence.py",
           "done = fused_cell.cell_(products(state, bias), cell, projection_input, self.cell_clip)",
           "done = fused_cell.cell_(products(state, bias), cell, projection_input, 0.0)", (SERVE_RECURRENCE,)),
    Mutant("serve recurrence, eager cell: cell clip removed", "serve/recurrence.py",
           "lstm_cell.cell_step(lstm_cell.activate_doubled_gates_(gates), view.cell, self.cell_clip,",
           "lstm_cell.cell_step(lstm_cell.activate_doubled_gates_(gates), view.cell, 0.0,", (SERVE_RECURRENCE,)),
    Mutant("serve recurrence: int8's input and recurrent products not split", "serve/recurrence.py",
           "    if is_int8(layer):\n        return [SplitGateProduct", "    if False:\n        return [SplitGateProduct",
           ("tests/test_int8.py::test_served_recurrence_takes_int8",)),
    Mutant("serve recurrence: a row's cell state carried into its next sentence", "serve/recurrence.py",
           "self.cell[:, :, started] = 0", "self.cell[:, :, started] *= 1", (SERVE_RECURRENCE,)),
    Mutant("serve recurrence: a row's projected state carried into its next sentence", "serve/recurrence.py",
           "self.layer_state[:, :, started, self.layer_state.shape[-1] // 2:] = 0",
           "self.layer_state[:, :, started, self.layer_state.shape[-1] // 2:] *= 1", (SERVE_RECURRENCE,)),
    Mutant("serve recurrence: a sentence leaves a step after its last token", "serve/recurrence.py",
           "self.ends.setdefault(first + size - 2, []).append(row)",
           "self.ends.setdefault(first + size - 1, []).append(row)",
           ("tests/test_serve_trust.py::test_a_sentence_leaves_after_its_last_token_step",)),
    Mutant("serve recurrence: the backward layers not put back in token order", "serve/recurrence.py",
           "layers[1:, :, dim:] = steps[:, ::-1, 1]", "layers[1:, :, dim:] = steps[:, :, 1]", (SERVE_RECURRENCE,)),
    Mutant("serve compaction: a moved sentence's cell state left behind", "serve/recurrence.py",
           "self.cell[:, :, new] = self.cell[:, :, old]", "self.cell[:, :, new] = 0", (SERVE_COMPACT,)),
    Mutant("serve compaction: a moved sentence's earlier outputs left behind", "serve/recurrence.py",
           "outputs[:, slot:slot + length, :, new] = outputs[:, slot:slot + length, :, old]", "pass",
           (SERVE_COMPACT,)),
    Mutant("serve recurrence: the sentence vector's average without the token layer", "serve/recurrence.py",
           "max(1, n_tokens * (n_layers + 1))", "max(1, n_tokens * n_layers)", (SERVE_VECTORS,)),
    # elmo serve: its limits and its key (serve/inputs.py, serve/app.py)
    Mutant("serve limits: exactly --max-inputs refused", "serve/inputs.py",
           "if len(items) + others > limits.max_inputs:", "if len(items) + others >= limits.max_inputs:", (SERVE_LIMITS,)),
    Mutant("serve limits: exactly --max-input-tokens refused", "serve/inputs.py",
           "if len(tokens) > limits.max_input_tokens:", "if len(tokens) >= limits.max_input_tokens:", (SERVE_LIMITS,)),
    Mutant("serve limits: a declared body of exactly --max-body-bytes refused", "serve/app.py",
           "if declared.isdigit() and int(declared) > limit:", "if declared.isdigit() and int(declared) >= limit:",
           (SERVE_LIMITS,)),
    Mutant("serve limits: a streamed body of exactly --max-body-bytes refused", "serve/app.py",
           "if size > limit:", "if size >= limit:", (SERVE_LIMITS,)),
    Mutant("serve: an overflowing mix answered with nulls", "serve/app.py",
           "if not np.isfinite(layers).all():", "if False:",
           ("tests/test_serve_trust.py::test_mix_weights_that_overflow_are_refused_not_answered_with_nulls",)),
    Mutant("serve key: the Bearer scheme read in one case only", "serve/app.py",
           'return scheme.lower() == b"bearer" and', 'return scheme == b"Bearer" and',
           ("tests/test_serve_trust.py::test_the_bearer_scheme_is_read_in_any_case",)),
    # the ONNX export (inference/onnx_export.py)
    Mutant("onnx scan: the projection clipped with the cell clip", "inference/onnx_export.py",
           "hidden = lstm_cell.clip_(torch.bmm(cell_output, projection), proj_clip)  # (D, B, P)",
           "hidden = lstm_cell.clip_(torch.bmm(cell_output, projection), cell_clip)  # (D, B, P)", (ONNX_CLIPPED,)),
    Mutant("onnx scan: cell clip removed", "inference/onnx_export.py",
           "lstm_cell.activate_gates(gates), cell, cell_clip)", "lstm_cell.activate_gates(gates), cell, 0.0)",
           (ONNX_CLIPPED,)),
    Mutant("onnx export: the check's tolerance loosened 10x", "inference/onnx_export.py",
           "TOLERANCE = 1e-5", "TOLERANCE = 1e-4",
           ("tests/test_mutants_onnx.py",
            "tests/test_onnx.py::test_the_check_rejects_a_difference_just_above_its_tolerance")),
    Mutant("onnx export: a NaN passes the check", "inference/onnx_export.py",
           "if not difference <= tolerance:  # NaN too", "if difference > tolerance:  # NaN too",
           ("tests/test_mutants_onnx.py",)),
    Mutant("onnx graph: a negative id read as a row from the end", "inference/onnx_export.py",
           "char_ids = torch.where(char_ids < 0, cnn.char_embedding.num_embeddings, char_ids)  # (N, W)",
           "char_ids = char_ids  # (N, W)", ("tests/test_onnx.py::test_ids_outside_the_table_are_errors_not_rows",)),
    Mutant("onnx helpers: id 262 accepted", "inference/onnx_export.py",
           "<= char_ids.max() < N_CHAR_IDS:", "<= char_ids.max() <= N_CHAR_IDS:", ("tests/test_mutants_onnx.py",)),
    # hub.Module (hub.py)
    Mutant("hub: trainable=False leaves the mix trainable", "hub.py",
           "self.elmo.mix.requires_grad_(trainable)", "self.elmo.mix.requires_grad_(True)", ("tests/test_hub.py",)),
    Mutant("hub: google/elmo/1 trains the char CNN", "hub.py",
           "self.elmo.bilm.token_encoder.requires_grad_(False)", "self.elmo.bilm.token_encoder.requires_grad_(True)",
           ("tests/test_hub.py",)),
    Mutant("hub: google/elmo/1 trains its LSTM with trainable=False", "hub.py",
           "train_lstm = trainable and isinstance(handle, str)", "train_lstm = isinstance(handle, str)",
           ("tests/test_hub.py",)),
    Mutant("hub: a None token read as the token 'None'", "hub.py",
           '_check_strings(row[:length], f"tokens[{index}]")', "pass", ("tests/test_hub.py",)),
    # downloads and the cache (download.py)
    Mutant("cache: the query ignored", "sources/cache.py", "if parts.query:  # the same path", "if False:  # the same path",
           (DOWNLOADS + "test_the_query_is_part_of_the_cache_key",)),
    Mutant("cache: a host of '..' taken", "sources/cache.py", 'or host in (".", "..") or', 'or host in (".",) or',
           (DOWNLOADS + "test_a_host_of_dot_dot_is_refused_and_nothing_is_made_outside",)),
    Mutant("cache: a leading '.' kept (a URL names a lock or a leftover)", "sources/cache.py",
           'return _cut("%2E" + name[1:] if name.startswith(".") else name)', "return _cut(name)",
           (DOWNLOADS + "test_every_cache_path_is_inside_the_cache",)),
    Mutant("download: a mirror's file cached as the published one", "sources/download.py",
           "trusted = source == canonical or", "trusted = True or",
           (DOWNLOADS + "test_a_mirror_without_a_pinned_hash_never_stands_in_for_the_published_file",)),
    Mutant("download: the pinned SHA-256 not compared", "sources/download.py",
           "if digest != expected.sha256:", "if False:",
           (DOWNLOADS + "test_a_mirror_file_whose_hash_differs_is_refused",)),
    Mutant("download: the cap not enforced while streaming", "sources/download.py",
           "if written > cap.size:", "if False:", (DOWNLOADS + "test_a_gzip_bomb_stops_at_the_cap",)),
    Mutant("download: the stall rule never fires", "sources/download.py",
           "if self.window_bytes < self.min_bytes:", "if self.window_bytes < 0:", ("tests/test_mutants_download.py",)),
    Mutant("download: a 5xx not retried", "sources/download.py",
           "if response.status_code >= 500:", "if response.status_code >= 600:",
           (DOWNLOADS + "test_http_errors_name_the_status_code",)),
    Mutant("download: an ftp:// mirror taken for a folder", "sources/download.py",
           'if "://" in mirror and mirror.split("://", 1)[0].lower() not in MIRROR_SCHEMES:', "if False:",
           (DOWNLOADS + "test_a_mirror_of_another_scheme_is_refused_by_name",)),
    # ELMoForManyLangs folders (model/manylangs.py, model/manylangs_files.py)
    Mutant("ManyLangs: their max_characters_per_token unbounded", "model/manylangs_files.py",
           '"token_embedder", 3, MAX_MANYLANGS_CHARACTERS)', '"token_embedder", 3)',
           ("tests/test_manylangs.py::test_every_size_of_their_config_is_bounded_before_allocating",)),
    Mutant("ManyLangs: the pickles unpickled unsafely", "model/manylangs_files.py",
           'torch.load(path, map_location="cpu", weights_only=True)',
           'torch.load(path, map_location="cpu", weights_only=False)',
           ("tests/test_manylangs.py::test_a_pickle_with_objects_is_refused_unrun",)),
    Mutant("ManyLangs: their gate order read as elmokit's", "model/manylangs_files.py",
           "_THEIR_GATES_TO_NATIVE = (0, 1, 3, 2)", "_THEIR_GATES_TO_NATIVE = (0, 1, 2, 3)", (MANYLANGS_NUMBERS,)),
    Mutant("ManyLangs: ids not shifted by one", "model/manylangs.py", "        return ids + 1\n", "        return ids\n",
           (MANYLANGS_NUMBERS,)),
    # the confidence of a task model's predictions (tasks/confidence.py)
    Mutant("confidence: a span includes the token after it", "tasks/confidence.py",
           "(positions < ends[:, None])  # (S, T)", "(positions <= ends[:, None])  # (S, T)",
           ("tests/test_confidence.py",)),
    Mutant("confidence: the token after a span may continue it", "tasks/confidence.py",
           "return (exact | ~inside[..., None]) & ~(after[..., None] & continues)",
           "return exact | ~inside[..., None]", ("tests/test_confidence.py",)),
    Mutant("confidence: every span divided by the first sentence's partition function", "tasks/confidence.py",
           "- log_z[rows]).exp()", "- log_z[0]).exp()", ("tests/test_confidence.py",)),
    Mutant("confidence, no CRF: padding counted in a span's product", "tasks/confidence.py",
           "torch.where(span_mask, mass, torch.ones_like(mass)).prod(dim=-1)", "mass.prod(dim=-1)",
           ("tests/test_confidence.py",)),
    Mutant("rows: the engine's rows the power of two below, not the nearest", "inference/streams.py",
           "by_length = 1 << round(math.log2(max(positions / STREAM_POSITIONS, 1)))",
           "by_length = 1 << int(math.log2(max(positions / STREAM_POSITIONS, 1)))", ("tests/test_rows.py",)),
    Mutant("rows: the gate budget left out of the engine's rows", "inference/streams.py",
           "return min(max(by_length, FEWEST_DEFAULT_ROWS), by_memory, MAX_DEFAULT_ROWS)",
           "return min(max(by_length, FEWEST_DEFAULT_ROWS), MAX_DEFAULT_ROWS)", ("tests/test_rows.py",)),
    Mutant("rows: no floor for a short call", "inference/streams.py",
           "return min(max(by_length, FEWEST_DEFAULT_ROWS), by_memory, MAX_DEFAULT_ROWS)",
           "return min(by_length, by_memory, MAX_DEFAULT_ROWS)", ("tests/test_rows.py",)),
    Mutant("rows: windows of 16 batches of the engine's rows, not of the position budget", "inference/embedder.py",
           "        return max(1, self.POSITION_BUDGET // 2)\n",
           "        return self.rows_for(None) * self.STREAM_WINDOW\n", ("tests/test_rows.py",)),
    Mutant("rows: each window its own rows (the reordered weights made again)", "inference/embedder.py",
           "            batch_size = batch_size or self.stream_rows(window)  # None: the first window's, for every window\n",
           "", ("tests/test_rows.py",)),
    Mutant("rows: each window of a file its own rows", "inference/files.py",
           "            batch_size = batch_size or embedder.stream_rows(texts)  # one row count for the whole stream\n",
           "", ("tests/test_rows.py",)),
    Mutant("rows: a stateful embedder's None also the engine's rows", "inference/embedder.py",
           "return self.DEFAULT_BATCH_SIZE if self.carried is not None", "return self.DEFAULT_BATCH_SIZE if False",
           ("tests/test_rows.py",)),
    Mutant("rows: elmo serve's rows without --rows the old fixed 64", "serve/app.py",
           "rows = embedder.rows_at(limits.max_batch_tokens)", "rows = 64",
           ("tests/test_serve.py::test_the_rows_are_the_engines_choice_for_the_batch_tokens_unless_given",)),
    Mutant("rows: elmo serve's --rows ignored (the engine's choice always)", "serve/app.py",
           "        if rows is None:\n            rows = embedder.rows_at(", "        if True:\n            rows = embedder.rows_at(",
           ("tests/test_serve.py::test_the_rows_are_the_engines_choice_for_the_batch_tokens_unless_given",)),
    # TF-Hub modules from disk (model/tf_bundle.py, sources/tfhub.py) and the Keras layer
    Mutant("tf bundle: a block's CRC not checked", "model/tf_bundle.py",
           "if crc32c(index[offset:offset + size + 1]) != unmask_crc(stored):", "if False:",
           (TFHUB + "test_damaged_data_and_index_fail_their_crc",)),
    Mutant("tf bundle: a tensor's CRC not checked", "model/tf_bundle.py",
           "if entry.crc32c is not None and crc32c(raw) != unmask_crc(entry.crc32c):", "if False:",
           (TFHUB + "test_damaged_data_and_index_fail_their_crc",)),
    Mutant("tf bundle: a tensor may end 4 bytes past its data file", "model/tf_bundle.py",
           "if entry.offset + entry.size > available:", "if entry.offset + entry.size > available + 4:",
           (TFHUB + "test_a_data_file_short_by_a_few_bytes",)),
    Mutant("tf bundle: CRC32C's chunks folded in the wrong order", "model/tf_bundle.py",
           "registers = _apply_operator(_zeros_operator(width), registers[0::2]) ^ registers[1::2]",
           "registers = _apply_operator(_zeros_operator(width), registers[1::2]) ^ registers[0::2]",
           ("tests/test_tfhub_module.py::test_crc32c_equals_the_bitwise_definition",)),
    Mutant("tf bundle: a CRC unmasked by the wrong rotation", "model/tf_bundle.py",
           "return ((rotated >> 17) | (rotated << 15)) & 0xFFFFFFFF", "return ((rotated >> 15) | (rotated << 17)) & 0xFFFFFFFF",
           (TFHUB + "test_entry_crcs_are_those_of_the_tensor_bytes",)),
    Mutant("TF-Hub: the char table's last row dropped, not its 'no token' row", "sources/tfhub.py",
           'arrays["char_embed"] = arrays["char_embed"][1:]', 'arrays["char_embed"] = arrays["char_embed"][:-1]',
           (TFHUB + "test_module_weights_equal_the_hdf5_files",)),
    Mutant("TF-Hub: no projection clip for an unpublished shape", "sources/tfhub.py",
           'PUBLISHED_CLIPS = {"cell_clip": 3.0, "proj_clip": 3.0}', 'PUBLISHED_CLIPS = {"cell_clip": 3.0, "proj_clip": 0.0}',
           (TFHUB + "test_module_weights_equal_the_hdf5_files",)),
    Mutant("TF-Hub: the module's scaling not the mix's gamma", "hub.py",
           "initial_gamma=scaling).to(module_device(self.bilm))", "initial_gamma=1.0).to(module_device(self.bilm))",
           (TFHUB + "test_hub_module_from_disk_has_the_modules_mix",)),
    Mutant("TF-Hub: the cache folder named by another hash of the handle", "sources/tfhub.py",
           'hashlib.sha1(handle.encode("utf-8")).hexdigest()', 'hashlib.sha256(handle.encode("utf-8")).hexdigest()',
           (TFHUB + "test_a_handle_uses_the_module_tfhub_cached",)),
    Mutant("TF-Hub: an archive member with '..' extracted", "sources/tfhub.py",
           'if name.startswith("/") or ".." in parts or', 'if name.startswith("/") or',
           (TFHUB + "test_hostile_archives_are_refused_before_writing",)),
    Mutant("download: a waiter counts what was written before it came as progress", "sources/download.py",
           "watch, seen = StallWatch(), _partial_bytes(target)", "watch, seen = StallWatch(), 0",
           ("tests/test_mutants_download.py::test_a_waiter_counts_only_what_the_download_writes_while_it_waits",)),
    # the elmo serve client of the LangChain and LlamaIndex integrations (integrations/texts.py, bounded_http.py)
    Mutant("client: the key kept on a redirect to another origin", "integrations/bounded_http.py",
           "if _origin(target) != _origin(url):", "if False:",
           ("tests/test_integration_texts.py::test_a_redirect_to_another_origin_is_followed_without_the_key",)),
    Mutant("client: a redirect to another scheme followed", "integrations/bounded_http.py",
           'if urlsplit(target).scheme not in ("http", "https"):', "if False:",
           ("tests/test_integration_texts.py::test_a_redirect_out_of_http_is_refused",)),
    Mutant("client: an answer read past its size cap", "integrations/bounded_http.py",
           "        if len(data) > max_bytes:\n", "        if len(data) > 2 * max_bytes:\n",
           ("tests/test_integration_texts.py::test_an_answer_is_read_to_a_bounded_size",)),
    Mutant("client: fewer vectors than texts taken", "integrations/texts.py",
           "    if len(data) != len(indices):\n", "    if len(data) > len(indices):\n",
           ("tests/test_integration_texts.py::test_an_answer_must_hold_one_finite_vector_of_one_width_per_text",)),
    Mutant("client: a list sent in one request, not batch_size texts a request", "integrations/texts.py",
           "for start in range(0, len(sent), self.batch_size)]", "for start in range(0, len(sent), len(sent))]",
           ("tests/test_integration_langchain.py::test_a_list_goes_to_the_server_batch_size_texts_a_request",)),
    # Parquet outputs (inference/segments.py's ParquetSegment) and the Ray corpus (ray.py, ray_corpus.py)
    Mutant("Parquet: rows keyed by their position, not their line column", "inference/segments.py",
           'yield from zip(map(str, lines[-1].tolist()), embedding_arrays(table["embedding"]))',
           'yield from zip(map(str, range(first - len(table), first)), embedding_arrays(table["embedding"]))',
           ("tests/test_parquet.py::test_read_embeddings_keys_rows_by_their_line_column",)),
    Mutant("Parquet: two rows of one line read back, one silently dropped", "inference/segments.py",
           "        if lines:\n            refuse_repeated_lines(", "        if False:\n            refuse_repeated_lines(",
           ("tests/test_parquet.py::test_read_embeddings_refuses_a_null_or_repeated_row",)),
    Mutant("Parquet: a row group written only at close (memory grows with the file)", "inference/segments.py",
           "        if self.pending_bytes >= self.row_group_bytes:\n", "        if False:\n",
           ("tests/test_parquet.py::test_row_groups_bound_memory_and_segments_merge",)),
    Mutant("Ray: a stale partial of another run kept under --overwrite", "ray.py",
           "        shutil.rmtree(partial, ignore_errors=True)  # a stale partial of another run\n", "\n",
           ("tests/test_ray.py::test_overwrite_removes_a_stale_partial_of_another_run",)),
    Mutant("Ray: a Parquet input's own line column taken with repeats", "ray_corpus.py",
           "    if own_lines:\n        refuse_repeated_lines(", "    if False:\n        refuse_repeated_lines(",
           ("tests/test_ray.py::test_a_parquet_inputs_own_line_column_must_be_unique_integers",)),
    Mutant("Ray: rows numbered from 0 in every block", "ray_corpus.py",
           "pa.array(np.arange(first, first + len(table)), pa.int64())",
           "pa.array(np.arange(0, len(table)), pa.int64())",
           ("tests/test_ray.py::test_a_null_past_the_first_block_is_named_with_its_row_in_the_file", "tests/test_ray.py")),
    Mutant("sentence-transformers: the prompt dropped", "integrations/sentence_transformers.py",
           "inputs = [prompt + text for text in inputs]", "inputs = list(inputs)",
           ("tests/test_integration_st.py::test_token_embeddings_are_each_texts_own_tokens_with_a_prompt",)),
    Mutant("sentence-transformers: a padding row kept in each text's token embeddings",
           "integrations/sentence_transformers.py",
           "mask = (torch.arange(width) < lengths.unsqueeze(1))", "mask = (torch.arange(width) <= lengths.unsqueeze(1))",
           ("tests/test_integration_st.py::test_token_embeddings_are_each_texts_own_tokens_with_a_prompt",)),
    Mutant("spaCy: whitespace tokens counted in the doc and span means", "integrations/spacy.py",
           "return token_mean(self.tokens(doc, start, end)[self.words(doc)[start:end]])",
           "return token_mean(self.tokens(doc, start, end))", ("tests/test_integration_spacy.py",)),
    Mutant("spaCy: a layer index read as the top layer", "integrations/spacy.py",
           "            return layers[self.layers]\n", "            return layers[-1]\n",
           ("tests/test_integration_spacy.py",)),
    Mutant("spaCy: a folder given relative kept as written (spacy.load elsewhere would miss it)",
           "integrations/spacy.py", "if saved_reference(model) != str(model) and not Path(model).is_absolute():",
           "if saved_reference(model) != str(model) and Path(model).is_absolute():",
           ("tests/test_integration_spacy.py::test_a_folder_given_relative_is_refused_as_spacy_would_save_it",)),
    Mutant("Parquet: a sliced column's offsets read from the parent's start", "inference/parquet.py",
           "        offsets -= offsets[0]  # a sliced array's offsets start past 0\n", "\n",
           ("tests/test_parquet.py",)),
    Mutant("Parquet: a row of fewer values than its lists' shape read as rectangular", "inference/parquet.py",
           "if int(np.prod(shape)) != ends[row] - starts[row]:", "if int(np.prod(shape)) < ends[row] - starts[row]:",
           ("tests/test_parquet.py",)),
    Mutant("Parquet: repeated line numbers found only two rows apart", "inference/parquet.py",
           "repeats = np.flatnonzero(np.diff(lines[order]) == 0)",
           "repeats = np.flatnonzero(lines[order][2:] == lines[order][:-2])",
           ("tests/test_parquet.py",)),
    Mutant("Flair: 'all' concatenates a token's features before its layers", "integrations/flair.py",
           "selected = selected.transpose(1, 2).flatten(2)", "selected = selected.permute(0, 2, 3, 1).flatten(2)",
           ("tests/test_integration_flair.py::test_token_vectors_equal_the_embedders",)),
    Mutant("Keras: the layer's mix variables not used", "integrations/keras.py",
           "outputs = elmo(char_ids, mix=(self.mix_weights.value, self.mix_scaling.value))", "outputs = elmo(char_ids)",
           ("tests/test_integration_keras.py::test_trainable_trains_the_mix_only_and_saves_by_reference",)),
]


# ---------------------------------------------------------------------------------------------
# The mutants against the code
# ---------------------------------------------------------------------------------------------
def stale_mutants(package: Path, mutants: list[Mutant]) -> list[str]:
    """Why each mutant that cannot be applied to the package at `package` (src/elmokit) cannot:
    its file is missing, its text occurs there other than exactly once, or it changes nothing;
    also a name used twice. Empty when every mutant applies."""
    problems, names = [], set()
    for mutant in mutants:
        if mutant.name in names:
            problems.append(f"{mutant.name!r}: the name is used twice")
        names.add(mutant.name)
        path = package / mutant.path
        if not path.is_file():
            problems.append(f"{mutant.name!r}: {mutant.path} does not exist")
            continue
        count = path.read_text(encoding="utf-8").count(mutant.old)
        if count != 1:
            problems.append(f"{mutant.name!r}: its text occurs {count} times in {mutant.path}, not once: "
                            f"{mutant.old.strip()[:80]!r}")
        if mutant.old == mutant.new:
            problems.append(f"{mutant.name!r}: the replacement is the text itself")
    return problems


def require_fresh(package: Path, mutants: list[Mutant]) -> None:
    """SystemExit naming every mutant that no longer matches the code (`stale_mutants`)."""
    problems = stale_mutants(package, mutants)
    if problems:
        sys.exit(f"{len(problems)} mutant(s) no longer match the code of {package}; update them in "
                 f"scripts/mutation.py:\n  " + "\n  ".join(problems))


# ---------------------------------------------------------------------------------------------
# The copy of the repository, and pytest in it
# ---------------------------------------------------------------------------------------------
def repository_files(repo: Path) -> list[Path]:
    """The files of the repository, relative: git's tracked and untracked-but-not-ignored ones
    (not the virtualenv, caches or runs), or without git src/, tests/ and pyproject.toml."""
    if (repo / ".git").exists():
        listing = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                 cwd=repo, capture_output=True, check=True).stdout.decode()
        return [Path(name) for name in sorted(set(listing.split("\0"))) if name and (repo / name).is_file()]
    return [path.relative_to(repo) for part in ("src", "tests") for path in (repo / part).rglob("*")
            if path.is_file() and "__pycache__" not in path.parts] + [Path("pyproject.toml")]


def copy_repository(source: Path, root: Path) -> Path:
    """The repository's files under root/repo; nothing beside it (no ../shared: as a fresh clone)."""
    repo = root / "repo"
    for relative in repository_files(source):
        (repo / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / relative, repo / relative, follow_symlinks=False)
    return repo


def copy_env(repo: Path) -> dict[str, str]:
    """The environment of the copy's tests: its src/ first on the path, CI=true (a golden test
    that skips fails), its own model cache, and no pytest plugin loaded by itself (the installed
    ones, for the integrations' tests, took most of a run's start on a loaded machine; a covering
    test that needed one would fail unmutated, and its mutants would not run)."""
    return {**os.environ, "PYTHONPATH": str(repo / "src"), "PYTHONDONTWRITEBYTECODE": "1", "CI": "true",
            "ELMOKIT_CACHE": str(repo.parent / "cache"), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


def require_copy_imported(repo: Path) -> None:
    """SystemExit unless `import elmokit` in the copy's environment imports the copy's package
    (an editable install of another tree must not win over PYTHONPATH)."""
    found = subprocess.run([sys.executable, "-c", "import elmokit; print(elmokit.__file__)"], cwd=repo,
                           env=copy_env(repo), capture_output=True, text=True).stdout.strip()
    if not found or not Path(found).resolve().is_relative_to((repo / "src").resolve()):
        sys.exit(f"in the copy, `import elmokit` gives {found or 'an error'}, not the copy's {repo / 'src'}")


def pytest_run(repo: Path, tests, timeout: float, options: tuple[str, ...] = ("-x",)) -> subprocess.CompletedProcess:
    """pytest on `tests` in the copy `repo`, -x unless other `options` are given (its exit status
    and output)."""
    return subprocess.run([sys.executable, "-m", "pytest", "-q", *options, "-p", "no:cacheprovider",
                           "-W", "ignore::pytest.PytestConfigWarning", *tests],
                          cwd=repo, env=copy_env(repo), capture_output=True, text=True, timeout=timeout)


def run_mutant(repo: Path, mutant: Mutant, timeout: float) -> tuple[str, float]:
    """Apply `mutant` to the copy, run its tests, restore the file: 'killed', 'SURVIVED',
    'timeout' or 'error (rc N)'."""
    path = repo / "src" / "elmokit" / mutant.path
    source = path.read_text(encoding="utf-8")
    if source.count(mutant.old) != 1:  # require_fresh ran on the same files: cannot happen
        raise RuntimeError(f"{mutant.name}: stale in the copy")
    path.write_text(source.replace(mutant.old, mutant.new), encoding="utf-8")
    start = time.perf_counter()
    try:
        returncode = pytest_run(repo, mutant.tests, timeout).returncode
        status = {0: "SURVIVED", 1: "killed"}.get(returncode, f"error (rc {returncode})")
    except subprocess.TimeoutExpired:
        status = "timeout"
    finally:
        path.write_text(source, encoding="utf-8")
    return status, time.perf_counter() - start


def in_parallel(repos: list[Path], tasks: list, describe) -> list:
    """Each task(repo) -> result run on a free copy (one worker per copy), `describe(task, result)`
    printed as each ends; the results in the tasks' order."""
    jobs: queue.Queue = queue.Queue()
    for index, task in enumerate(tasks):
        jobs.put((index, task))
    results: dict = {}
    lock = threading.Lock()

    def work(repo: Path) -> None:
        while True:
            try:
                index, task = jobs.get_nowait()
            except queue.Empty:
                return
            result = task(repo)
            with lock:
                results[index] = result
                print(describe(task, result), flush=True)

    threads = [threading.Thread(target=work, args=(repo,)) for repo in repos]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [results[index] for index in range(len(tasks))]


def run_unmutated(repos: list[Path], tests: list[str], timeout: float) -> tuple[str, set[str]]:
    """The covering tests on the unmutated copies, split among them (without -x): their counts
    ("412 passed, 2 skipped") and the node ids that failed or errored (a mutant whose tests fail
    unmutated is not run: it could only be "killed")."""
    groups = [group for group in (tests[index::len(repos)] for index in range(len(repos))) if group]
    runs = in_parallel(repos, [lambda repo, group=group: pytest_run(repo, group, timeout, ("-rfE",)) for group in groups],
                       lambda task, run: f"unmutated: {_summary(run.stdout)}")
    counts: dict[str, int] = {}
    failed: set[str] = set()
    for run in runs:
        for number, word in re.findall(r"(\d+) (passed|skipped|failed|errors?|xfailed|xpassed|deselected)",
                                       _summary(run.stdout)):
            counts[word] = counts.get(word, 0) + int(number)
        failed |= set(re.findall(r"^(?:FAILED|ERROR) (\S+)", run.stdout, re.M))
        if run.returncode not in (0, 1):
            sys.exit(f"pytest could not run the covering tests (rc {run.returncode}):\n{run.stdout[-4000:]}")
    return ", ".join(f"{number} {word}" for word, number in counts.items()), failed


def fails_unmutated(mutant: Mutant, failed: set[str]) -> bool:
    """Whether one of the mutant's tests (a file or a node id) failed unmutated."""
    return any(node == test or node.startswith(test + "::") or node.startswith(test + "[") for node in failed
               for test in mutant.tests)


def _summary(output: str) -> str:
    """pytest's last line ("12 passed, 1 skipped in 3.2s"), without its '=' signs."""
    return (output.strip().splitlines() or ["(no output)"])[-1].strip("= ")


# ---------------------------------------------------------------------------------------------
# The page
# ---------------------------------------------------------------------------------------------
def outcome(status: str, mutant: Mutant) -> str:
    """What the page says of a result: killed, equivalent (argued), or the status as it is."""
    return "equivalent" if status == "SURVIVED" and mutant.equivalent else status


def page(rows: list[tuple[Mutant, str, float]], runs: list[str]) -> str:
    """The page: the figures, how the mutants ran, `runs` (a line for each run whose results it
    holds), a row per mutant, and the argument of each mutant counted equivalent."""
    outcomes = [outcome(status, mutant) for mutant, status, _ in rows]
    killed, equivalent = outcomes.count("killed"), outcomes.count("equivalent")
    survived = outcomes.count("SURVIVED")
    other = len(rows) - killed - equivalent - survived
    lines = ["# Mutation testing (`scripts/mutation.py`)", "",
             f"{len(rows)} mutants: {killed} killed, {equivalent} survived and argued equivalent below, "
             f"{survived} survived unargued" + (f", {other} not run, timed out or errored" if other else "") + ".", "",
             "Each mutant is one line of the library changed in a copy of the repository (its files as git lists "
             "them, no `../shared` beside it, as a fresh clone); the tests that should kill it ran with "
             "`pytest -x` and `CI=true` (a golden test that skips fails). Killed = they failed. A mutant whose text "
             "no longer occurs exactly once in its file fails the run before anything runs.", "",
             "Runs (a row's result is from the last run that ran it; before any mutant, the run's covering tests "
             "ran unmutated):", "", *runs, "",
             "| mutant | file | tests | result |", "|---|---|---|---|"]
    lines += [f"| {m.name} | `{m.path}` | {', '.join(t.removeprefix('tests/') for t in m.tests)} | {result} |"
              for (m, _, _), result in zip(rows, outcomes)]
    argued = [(m, result) for (m, _, _), result in zip(rows, outcomes) if result == "equivalent"]
    if argued:
        lines += ["", "## Why the surviving mutants are equivalent", ""]
        lines += [f"- **{m.name}** (`{m.path}`): {m.equivalent}" for m, _ in argued]
    return "\n".join(lines) + "\n"


def read_page(path: Path) -> tuple[dict[str, str], list[str]]:
    """An earlier page's result by mutant name, and its lines of runs (`--update`)."""
    text = path.read_text(encoding="utf-8")
    results = {name: result for name, result in re.findall(r"^\| (.+?) \| `.+?` \| .*? \| (.+?) \|$", text, re.M)}
    runs = re.findall(r"^- `python scripts/mutation\.py.*$", text, re.M)
    old = re.search(r"Unmutated, the covering tests: (.*)\. Written by `(.*)` in (\d+) min\.", text)  # the first format
    if old:
        runs.append(f"- `{old.group(2)}`: {len(results)} mutants; unmutated, their tests: {old.group(1)}; "
                    f"{old.group(3)} min.")
    return results, runs


def merge_pages(output: Path, newer: Path) -> None:
    """Write `output` with every mutant's result from `newer` where it has one, else from `output`
    (each a page of this script); the runs of both listed. SystemExit if a mutant is on neither."""
    (earlier, earlier_runs), (later, later_runs) = read_page(output), read_page(newer)
    missing = [m.name for m in MUTANTS if m.name not in later and m.name not in earlier]
    if missing:
        sys.exit(f"--merge: {len(missing)} mutant(s) are on neither page: {missing}")
    rows = []
    for mutant in MUTANTS:
        result = later.get(mutant.name, earlier.get(mutant.name))
        rows.append((mutant, "SURVIVED" if result == "equivalent" else result, 0.0))
    partial = output.with_name(f".{output.name}.partial")
    partial.write_text(page(rows, earlier_runs + later_runs), encoding="utf-8")
    os.replace(partial, output)


def commit_of(repo: Path) -> str:
    """The repository's commit (short), "+ changes" when its files differ from it; "no git" without."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "no git"
    return head + (" + changes" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="run the mutants whose name this regular expression finds")
    parser.add_argument("--check", action="store_true", help="only check that every mutant matches the code")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once (one copy of the repository each)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds a mutant's tests may run")
    parser.add_argument("--update", action="store_true",
                        help="run only the --only mutants and replace their rows in --output (the others' kept)")
    parser.add_argument("--merge", type=Path, help="run nothing: take the rows and runs of this page (a run of some "
                                                   "mutants) into --output, the other rows kept")
    parser.add_argument("--output", type=Path, default=PAGE)
    args = parser.parse_args()
    mutants = [m for m in MUTANTS if not args.only or re.search(args.only, m.name)]
    if args.merge:
        merge_pages(args.output, args.merge)
        return
    previous, runs = read_page(args.output) if args.update else ({}, [])
    missing = [m.name for m in MUTANTS if m not in mutants and m.name not in previous]
    if args.update and missing:
        sys.exit(f"--update: {len(missing)} mutant(s) not selected are not on {args.output} either: {missing}")
    if not mutants:
        sys.exit(f"no mutant's name contains {args.only!r}")
    require_fresh(REPO / "src" / "elmokit", MUTANTS)
    if args.check:
        print(f"{len(MUTANTS)} mutants, each matching its file once")
        return
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="elmokit-mutation-") as folder:
        repos = [copy_repository(REPO, Path(folder) / f"copy{index}") for index in range(max(1, args.jobs))]
        require_fresh(repos[0] / "src" / "elmokit", mutants)
        require_copy_imported(repos[0])
        tests = list(dict.fromkeys(test for mutant in mutants for test in mutant.tests))
        baseline, failed = run_unmutated(repos, tests, 4 * args.timeout)  # unmutated, the tests must pass
        if failed:
            print(f"failing unmutated (their mutants are not run): {' '.join(sorted(failed))}", flush=True)
        rows = in_parallel(repos, [lambda repo, m=mutant: (m, *(("not run: its tests fail unmutated", 0.0)
                                                                 if fails_unmutated(m, failed)
                                                                 else run_mutant(repo, m, args.timeout)))
                                   for mutant in mutants],
                           lambda task, row: f"{row[1]:>10}  {row[2]:6.1f} s  {row[0].name}")
    command = ("python scripts/mutation.py" + (f" --only '{args.only}'" if args.only else "")
               + (" --update" if args.update else "") + (f" --jobs {args.jobs}" if args.jobs > 1 else ""))
    runs.append(f"- `{command}` at {commit_of(REPO)}: {len(rows)} mutants; unmutated, their tests: {baseline}; "
                f"{(time.perf_counter() - started) / 60:.0f} min.")
    if args.update:  # every mutant of the script, in its order: the ones run now, the others as the page had them
        ran = {mutant.name: (mutant, status, seconds) for mutant, status, seconds in rows}
        rows = [ran.get(m.name) or (m, "SURVIVED" if previous[m.name] == "equivalent" else previous[m.name], 0.0)
                for m in MUTANTS]
    partial = args.output.with_name(f".{args.output.name}.partial")
    partial.write_text(page(rows, runs), encoding="utf-8")
    os.replace(partial, args.output)
    survivors = [(m, status) for m, status, _ in rows if outcome(status, m) not in ("killed", "equivalent")]
    killed = sum(status == "killed" for _, status, _ in rows)
    print(f"{killed}/{len(rows)} killed; wrote {args.output}")
    for mutant, status in survivors:
        print(f"  {status}: {mutant.name} ({mutant.path}; {', '.join(mutant.tests)})")
    if survivors:
        sys.exit(f"{len(survivors)} mutant(s) neither killed nor argued equivalent")


if __name__ == "__main__":
    main()
