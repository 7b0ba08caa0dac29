"""A HuggingFace tokenizer folder made from a GGUF file, for tools that want one and reach no model hub (aiperf).

The GGUF file carries the whole tokenizer of a byte-level BPE model (`tokenizer.ggml.model` = gpt2): the tokens, the
merges, the token types, the special token ids, the pre-tokenizer's name and the chat template. This module turns
them into `tokenizer.json` (the `tokenizers` library's format, the pre-tokenizer being llama.cpp's own regular
expressions for that name, applied one after the other as llama.cpp does), `tokenizer_config.json` (special tokens,
chat template, `PreTrainedTokenizerFast`) and `special_tokens_map.json`, which `transformers.AutoTokenizer` loads
from the folder. A `gguf.sha256` stamp in the folder makes a second build of the same file a no-op.

aiperf, with `HF_HUB_OFFLINE=1`, loads a tokenizer only from the HuggingFace hub cache (it looks the name up with
`snapshot_download(local_files_only=True)`, which rejects a folder path), so `--hub-cache DIR --repo-id ORG/NAME`
also lays the folder out there as a snapshot of that repository: `HF_HUB_CACHE=DIR HF_HUB_OFFLINE=1` then lets it
load `--tokenizer ORG/NAME` with no network.

`check` compares the result with llama-server's own `POST /tokenize` (`add_special: false`) on varied texts (prose,
Unicode, code, digits, punctuation, whitespace) and prints the agreement.

It needs the PyPI packages `gguf` and `tokenizers` (scripts/get-aiperf.sh puts them in aiperf's virtualenv), and for
`--transformers` also `transformers`; `check` uses the standard library only for HTTP.

Run:  python bench/gguf_tokenizer.py build MODEL.gguf OUT_DIR [--hub-cache DIR --repo-id local/smollm2]
      python bench/gguf_tokenizer.py check OUT_DIR --url http://127.0.0.1:8080 [--transformers]
Exit status of check: 0 when every text agrees, 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# llama.cpp's pre-tokenizer regular expressions (src/llama-vocab.cpp, build 11434) by `tokenizer.ggml.pre`.
_GPT2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
_LLAMA3 = ("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?"
           "[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
PRE_REGEXES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"),
                    ("\\p{N}", _GPT2)),
    **dict.fromkeys(("gpt-2", "mpt", "olmo", "jais", "trillion"), (_GPT2,)),
    **dict.fromkeys(("llama-bpe", "llama3", "dbrx", "smaug-bpe"), (_LLAMA3,)),
}
CONTROL, USER_DEFINED = 3, 4   # gguf token types that are added tokens (control ones special)
STAMP = "gguf.sha256"

CHECK_TEXTS = (
    "The quick brown fox jumps over the lazy dog. It wasn't the dog's fault; they'd all gone home.",
    "Ünïcödé: café, naïve, façade — “quotes”, ‘single’, ½ × 3 ≈ 1.5; 日本語のテキスト、中文文本，한국어. 🙂🚀👍🏽",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)  # O(2**n)\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", arr[i] * 31337); }\t// tabs\tand\t\tspaces   ",
    "Prices: $1,234.56 or €99; call +1 (555) 123-4567 on 2024-02-29 at 23:59:59. Version 3.14159265358979.",
    "!!!??? ... --- *** ### @@@ ((( ))) [[ ]] {{ }} <html><body class='x'>&amp;&lt;</body></html> ~`^|\\/",
    "   leading spaces\n\n\nblank lines\r\nwindows line\n\ttabbed\n   \n trailing   ",
    "I'M SHOUTING, you're whispering; we'll see. THEY'VE gone. She'd've known. o'clock rock'n'roll",
    "Ελληνικά κείμενο, русский текст, العربية, עברית, हिन्दी पाठ, ไทย",
    "a" * 50 + " " + "ab" * 30 + " 0000000000 1111 ______ ====== \\n\\t literal escapes",
)


def _value(field: Any) -> Any:
    """A scalar or string GGUF field's value (gguf >= 0.17 has `contents()`)."""
    return field.contents()


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_gguf(path: str) -> dict[str, Any]:
    """The tokenizer fields of a GGUF file."""
    import gguf

    reader = gguf.GGUFReader(path)
    fields = reader.fields
    out: dict[str, Any] = {}
    for key, field in fields.items():
        if key.startswith("tokenizer.") or key.endswith(".context_length") or key == "general.architecture":
            out[key] = _value(field)
    return out


def build_tokenizer(meta: dict[str, Any]) -> Any:
    """A `tokenizers.Tokenizer` equal to llama.cpp's tokenizer of a byte-level BPE GGUF."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise SystemExit(f"gguf_tokenizer: tokenizer.ggml.model={kind!r}: only byte-level BPE ('gpt2') is supported")
    pre = str(meta.get("tokenizer.ggml.pre", "gpt-2"))
    if pre not in PRE_REGEXES:
        raise SystemExit(f"gguf_tokenizer: pre-tokenizer {pre!r} not supported (known: {', '.join(PRE_REGEXES)})")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in PRE_REGEXES[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    added = [AddedToken(tokens[i], special=types[i] == CONTROL, normalized=False)
             for i in range(len(tokens)) if types[i] in (CONTROL, USER_DEFINED)]
    tokenizer.add_tokens(added)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        name = tokens[int(bos)]
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{name} $A", pair=f"{name} $A {name} $B",
                                                                 special_tokens=[(name, int(bos))])
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def build(gguf_path: str, out_dir: str, force: bool = False) -> Path:
    """Write the tokenizer folder for `gguf_path` into `out_dir` (a no-op when it is already there for that file)."""
    out = Path(out_dir)
    digest = file_digest(gguf_path)
    stamp = out / STAMP
    if not force and stamp.is_file() and stamp.read_text().strip() == digest and (out / "tokenizer.json").is_file():
        return out
    meta = read_gguf(gguf_path)
    tokenizer = build_tokenizer(meta)
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])

    def name(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if i is None else tokens[int(i)]

    arch = meta.get("general.architecture", "")
    ctx = meta.get(f"{arch}.context_length")
    specials = {k: v for k, v in (("bos_token", name("bos")), ("eos_token", name("eos")),
                                  ("unk_token", name("unknown")), ("pad_token", name("padding"))) if v is not None}
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": int(ctx) if ctx else 8192,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        **specials,
    }
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False))
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=1, ensure_ascii=False))
    stamp.write_text(digest + "\n")
    return out


def add_to_hub_cache(folder: str | Path, cache_dir: str | Path, repo_id: str) -> Path:
    """Lay `folder` out in a HuggingFace hub cache as the `main` snapshot of `repo_id` (files copied; the revision is
    the GGUF digest). Returns the snapshot folder."""
    folder = Path(folder)
    revision = (folder / STAMP).read_text().strip()[:40]
    repo = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    if not (snapshot / "tokenizer.json").is_file():
        tmp = snapshot.with_name(revision + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(folder, tmp)
        shutil.rmtree(snapshot, ignore_errors=True)
        tmp.rename(snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def server_tokens(url: str, text: str) -> list[int]:
    body = json.dumps({"content": text, "add_special": False}).encode()
    req = urllib.request.Request(url.rstrip("/") + "/tokenize", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return [int(t) for t in json.loads(resp.read())["tokens"]]


def check(folder: str, url: str, texts: Sequence[str] = CHECK_TEXTS, use_transformers: bool = False) -> dict[str, Any]:
    """Token ids of `texts` by the folder's tokenizer against llama-server's `/tokenize`; a summary dict."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    encoders = {"tokenizers": lambda t: tok.encode(t, add_special_tokens=False).ids}
    if use_transformers:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(folder)
        encoders["transformers"] = lambda t: list(hf.encode(t, add_special_tokens=False))
    rows = []
    for text in texts:
        want = server_tokens(url, text)
        row: dict[str, Any] = {"text": text[:40], "server_tokens": len(want)}
        for label, encode in encoders.items():
            got = encode(text)
            row[label] = got == want
            if got != want:
                first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                             min(len(got), len(want)))
                row[f"{label}_diff"] = {"at": first, "got": got[first:first + 5], "server": want[first:first + 5],
                                        "got_len": len(got)}
        rows.append(row)
    agree = {label: sum(1 for r in rows if r[label]) for label in encoders}
    return {"texts": len(rows), "agree": agree, "tokens": sum(r["server_tokens"] for r in rows), "rows": rows}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write the tokenizer folder of a GGUF file")
    b.add_argument("gguf")
    b.add_argument("out")
    b.add_argument("--force", action="store_true", help="rebuild even when the folder is up to date")
    b.add_argument("--hub-cache", metavar="DIR", help="also lay it out in this HuggingFace hub cache (HF_HUB_CACHE)")
    b.add_argument("--repo-id", default="local/gguf-tokenizer", help="its repository id there")
    c = sub.add_parser("check", help="compare with llama-server's /tokenize")
    c.add_argument("folder")
    c.add_argument("--url", required=True, help="llama-server's base URL")
    c.add_argument("--transformers", action="store_true", help="also load the folder with transformers.AutoTokenizer")
    c.add_argument("--json", action="store_true", help="print the summary as one JSON document")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        folder = build(args.gguf, args.out, force=args.force)
        print(f"TOKENIZER_DIR={folder}")
        if args.hub_cache:
            print(f"TOKENIZER_SNAPSHOT={add_to_hub_cache(folder, args.hub_cache, args.repo_id)}")
            print(f"TOKENIZER_NAME={args.repo_id}")
        return 0
    summary = check(args.folder, args.url, use_transformers=args.transformers)
    if args.json:
        print(json.dumps(summary, ensure_ascii=False))
    else:
        for r in summary["rows"]:
            marks = " ".join(f"{k}={'ok' if r[k] else 'DIFF'}" for k in summary["agree"])
            print(f"  {r['server_tokens']:4d} tokens  {marks}  {r['text']!r}")
            for k in summary["agree"]:
                if f"{k}_diff" in r:
                    print(f"      {k}: {r[f'{k}_diff']}")
        print("agreement: " + ", ".join(f"{k} {n}/{summary['texts']} texts" for k, n in summary["agree"].items())
              + f" ({summary['tokens']} tokens)")
    return 0 if all(n == summary["texts"] for n in summary["agree"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
