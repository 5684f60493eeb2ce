"""`lmt prepare`: raw text to memory-mapped token shards (see data/prepare.py for the format and guarantees).

Wired into the main CLI by `add_subcommands(subparsers)` and `COMMANDS`; bad input raises ConfigError (one
line on stderr, exit 2).

    lmt prepare corpus/ --out data/corpus                        # byte tokenizer
    lmt prepare a.jsonl.zst b.parquet --out data/ab --tokenizer tokenizer.json --workers 8
    lmt prepare corpus/ --out data/bpe --train-tokenizer 8192   # a byte-level BPE trained here, then used
    lmt prepare hf_saved/ --text-field content --out data/hf     # datasets.save_to_disk folder, column 'content'
    lmt prepare --verify data/corpus                             # re-hash every shard against the manifest
"""

from __future__ import annotations

import argparse
import os

from large_model_training.errors import ConfigError


def add_subcommands(subparsers) -> None:
    """Add `prepare` to the main CLI's subparsers."""
    prep = subparsers.add_parser(
        "prepare",
        allow_abbrev=False,
        help="tokenize raw text into memory-mapped shards for lmt train --data",
        description="Read text files, folders, JSON Lines (.jsonl, .jsonl.gz, .jsonl.zst; field 'text'), "
        "Parquet and Arrow ('text' column) and Hugging Face datasets.save_to_disk folders; write "
        "token shards with a document index and a manifest. The same output for any --workers; "
        "a killed prepare resumes when run again.",
    )
    prep.add_argument("inputs", nargs="*", metavar="INPUT", help="files or folders (none: the Python stdlib)")
    prep.add_argument("--out", metavar="DIR", help="output folder (required unless --verify)")
    prep.add_argument("--tokenizer", default="", metavar="FILE", help="Hugging Face tokenizer.json [bytes]")
    prep.add_argument(
        "--eod-token",
        default=None,
        metavar="TOKEN",
        help="the tokenizer's end-of-document token [found among its special tokens]",
    )
    prep.add_argument(
        "--train-tokenizer",
        type=int,
        default=0,
        metavar="VOCAB",
        help="train a byte-level BPE tokenizer of VOCAB ids on the input first (written to DIR)",
    )
    prep.add_argument(
        "--workers", type=int, default=min(8, os.cpu_count() or 1), help="tokenizing processes [CPU count, at most 8]"
    )
    prep.add_argument(
        "--val-fraction",
        type=float,
        default=0.02,
        help="every 1/FRACTION-th document is held out for validation [0.02]",
    )
    prep.add_argument("--shard-mb", type=float, default=256.0, help="size of a training shard in MB [256]")
    prep.add_argument(
        "--text-field",
        default="text",
        metavar="NAME",
        help="the JSON Lines field or Parquet/Arrow column holding the text [text]",
    )
    prep.add_argument("--verify", action="store_true", help="check INPUT's shards against their checksums")


def cmd_prepare(args: argparse.Namespace) -> int:
    from large_model_training.data.prepare import PrepareRequest, prepare
    from large_model_training.data.prepared import verify_prepared

    if args.verify:
        if len(args.inputs) != 1:
            raise ConfigError("--verify takes one prepared folder")
        manifest = verify_prepared(args.inputs[0])
        print(f"lmt: {args.inputs[0]}: {_summary(manifest)}; every shard matches its checksum")
        return 0
    if not args.out:
        raise ConfigError("lmt prepare needs --out DIR")
    request = PrepareRequest(
        inputs=args.inputs,
        tokenizer=args.tokenizer,
        eod_token=args.eod_token,
        train_tokenizer=args.train_tokenizer,
        val_fraction=args.val_fraction,
        shard_mb=args.shard_mb,
        text_field=args.text_field,
    )
    if args.tokenizer and not os.path.isfile(args.tokenizer):
        raise ConfigError(f"tokenizer file not found: {args.tokenizer}")
    manifest = prepare(request, args.out, workers=args.workers)
    print(f"lmt: prepared {args.out}: {_summary(manifest)}")
    return 0


def _summary(manifest: dict) -> str:
    train, val = manifest["splits"]["train"], manifest["splits"]["val"]
    return (
        f"{train['documents']:,} train / {val['documents']:,} validation documents, {train['tokens']:,} / "
        f"{val['tokens']:,} tokens ({manifest['dtype']}, {len(train['shards'])} shards, tokenizer "
        f"{manifest['tokenizer']['name']}, vocabulary {manifest['tokenizer']['vocab_size']})"
    )


COMMANDS = {"prepare": cmd_prepare}
