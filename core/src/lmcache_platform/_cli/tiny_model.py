"""``lmcache-platform tiny-model DIR``: a tiny random-weight model and its tokenizer, no hub needed.

For trying the vLLM connector where no model can be downloaded (a laptop offline, an
air-gapped host, CI): vLLM runs the directory as its model with ``--load-format dummy``
(random weights it makes itself), or without that flag after ``--weights SEED`` wrote
seeded weights. The files come from :mod:`lmcache_platform._tinymodel`, which the test
suite's engines use too. Needs ``tokenizers`` (and, for ``--weights``, ``transformers``
and torch): all come with vLLM, so run it from the venv that has vLLM.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .._tinymodel import KINDS, MULTIMODAL_KINDS

_EPILOG = """\
The model is a directory: config.json (a 4-layer, 256-wide Qwen2-style model by default),
tokenizer.json and tokenizer_config.json (a byte-level BPE filling the vocabulary).
Start vLLM on it with --load-format dummy, or pass --weights SEED here to write seeded
random weights (model.safetensors). Outputs are random text; the KV cache is real.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = _EPILOG
    parser.add_argument(
        "directory", metavar="DIR", type=Path, help="where to write the model (created if missing)"
    )
    parser.add_argument(
        "--kind",
        default="gqa",
        choices=sorted([*KINDS, *MULTIMODAL_KINDS]),
        help="architecture: gqa (Qwen2, default), sliding (Mistral), hybrid (Gemma-2), mla "
        "(DeepSeek-V2), mamba2, llava (multimodal)",
    )
    parser.add_argument(
        "--no-tokenizer", dest="tokenizer", action="store_false", help="write config.json only"
    )
    parser.add_argument(
        "--weights",
        type=int,
        metavar="SEED",
        help="also write seeded random weights (needs transformers and torch), so vLLM needs no "
        "--load-format dummy",
    )


def run(args: argparse.Namespace) -> int:
    from .._tinymodel import make_tiny_model, write_weights

    try:
        path = make_tiny_model(args.directory, args.kind, tokenizer=args.tokenizer)
        if args.weights is not None:
            write_weights(path, args.weights)
    except ModuleNotFoundError as exc:
        print(
            f"lmcache-platform tiny-model: needs the {exc.name} package, which comes with vLLM: "
            "run this command from the venv that has vLLM",
            file=sys.stderr,
        )
        return 2
    except OSError as exc:
        print(f"lmcache-platform tiny-model: cannot write {args.directory}: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0
