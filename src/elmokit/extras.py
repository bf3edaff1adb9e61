"""Optional dependencies: which extra brings which package, and the error when one is missing.

`pip install elmokit` brings what embedding needs (torch, numpy, h5py, safetensors, tqdm; requests,
urllib3, filelock and platformdirs for models named by URL or published name). The
rest is imported only where it is used, after `require` has checked it is there:

| extra | packages | used by |
| --- | --- | --- |
| `plot` | matplotlib | `curves.png` of `elmo train`, `elmo similar --plot`, the task and probe figures |
| `prepare` | sacremoses, sentencex | `elmo prepare`, Moses tokenization (`--tokenize`) |
| `zh` | jieba, sentencex | `elmo prepare --lang zh`: Chinese word segmentation |
| `serve` | starlette, uvicorn, httptools, prometheus_client, orjson, sacremoses | `elmo serve`: the HTTP service and its page |
| `onnx` | onnx, onnxruntime, onnxscript | `elmo convert --to-onnx`: the biLM as one ONNX graph (onnxscript: torch's exporter) |
| `flair` | flair | `elmokit.integrations.flair.ELMoEmbeddings`: Flair's token embeddings |
| `spacy` | spacy | the `elmo` pipe of spaCy (`nlp.add_pipe("elmo")`) |
| `sentence-transformers` | sentence-transformers, huggingface_hub, sacremoses | `elmo convert --to-sentence-transformers`, the Hugging Face layout |
| `langchain` | langchain-core, sacremoses | `elmokit.integrations.langchain.ELMoEmbeddings` |
| `llama-index` | llama-index-core, sacremoses | `elmokit.integrations.llama_index.ELMoEmbedding` |
| `keras` | keras | `elmokit.integrations.keras.ElmoEmbedding`: ELMo as a Keras 3 layer (torch backend) |
| `parquet` | pyarrow | `elmo embed OUTPUT.parquet`, `elmokit.read_embeddings` of Parquet |
| `ray` | ray[data], pyarrow | `elmokit.ray.embed_dataset`, `elmo embed --ray` |
| `all` | all of the above | |
"""

from __future__ import annotations

import importlib

EXTRAS: dict[str, tuple[str, ...]] = {
    "plot": ("matplotlib",),
    "prepare": ("sacremoses", "sentencex"),
    "zh": ("jieba", "sentencex"),
    "serve": ("starlette", "uvicorn", "httptools", "prometheus_client", "orjson", "sacremoses"),
    "onnx": ("onnx", "onnxruntime", "onnxscript"),
    "flair": ("flair",),
    "spacy": ("spacy",),
    "sentence-transformers": ("sentence_transformers", "huggingface_hub", "sacremoses"),
    "langchain": ("langchain_core", "sacremoses"),
    "llama-index": ("llama_index.core", "sacremoses"),
    "keras": ("keras",),
    "parquet": ("pyarrow",),
    "ray": ("ray", "pyarrow"),
}
"""The packages of each optional extra, as imported (their pip names with `-` and `.` written `_`)."""


class MissingExtraError(ImportError):
    """An optional package is not installed; the message names the extra that brings it."""


def require(extra: str, purpose: str, packages: tuple[str, ...] | None = None) -> None:
    """Check that the packages `purpose` needs from `extra` can be imported, else say how to get them.

    Args:
        extra: a key of `EXTRAS`, e.g. "prepare".
        purpose: what needs them, as the message starts, e.g. "elmo prepare".
        packages: the packages of the extra that `purpose` needs (default: all of them).

    Raises:
        MissingExtraError: e.g. "elmo prepare needs sacremoses and sentencex:
            pip install 'elmokit[prepare]'", when any of `packages` fails to import.
    """
    packages = EXTRAS[extra] if packages is None else packages
    unknown = set(packages) - set(EXTRAS[extra])
    if unknown:
        raise ValueError(f"extra {extra!r} has no package {sorted(unknown)}; it has {list(EXTRAS[extra])}")
    for package in packages:
        try:
            importlib.import_module(package)
        except ImportError as error:
            raise MissingExtraError(
                f"{purpose} needs {' and '.join(packages)}: pip install 'elmokit[{extra}]'",
                name=package) from error
