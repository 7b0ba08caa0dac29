"""Chat-completions request bodies as real clients send them, deterministic from a seed (tests, benchmarks).

Why: the older helpers (`harness.story`, the tests' `words`) build prompts of tidy, unique, lower-case words in one
role. Real traffic has mixed case, punctuation, Unicode (accents, combining marks, CJK, RTL, emoji), code blocks,
markdown, several system messages, a `tools` array, tool calls and their results, `name` fields and images. It also
has near-duplicates: the same words sent with another case, punctuation, role, tools, tool arguments, name or image.
A cache that keys prompts by their lower-cased `\\w+` words of message contents (`prefix.raw_prefix`, `prefix.words`)
sees such near-duplicates as one prompt, while the server's chat template and tokenizer see different tokens. These
generators make that traffic cheap to write tests with.

- `harness(seed)`: one client program: a long system prompt and the `tools` all its conversations share.
- `Conversation` / `conversation(seed, harness)`: the successive request bodies of one conversation, each one the
  previous request's messages plus the assistant's answer (given text, or `placeholder(i)`) and a new user message,
  or a tool call and its results.
- `request(seed, n_words)`: one body of about n_words words.
- `variant(body, kind)` / `variants(body)`: near-duplicates that differ in one way only (see `KINDS`).

Stdlib only, and the same seed gives the same bodies on every machine (`random.Random` seeded with a string, no
`hash()`, stored-deflate PNGs).
"""

from __future__ import annotations

import base64
import copy
import json
import random
import re
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "KINDS", "SAME_TEXT_ONLY_WORDS", "Conversation", "Harness", "assistant_text", "conversation", "count_words",
    "fill_answer", "harness", "image_part", "placeholder", "png", "request", "sentence", "text", "variant", "variants",
]

Body = dict[str, Any]
Message = dict[str, Any]

_WORD = re.compile(r"\w+")

_NOUNS = (
    "cache", "prompt", "server", "request", "slot", "token", "model", "file", "answer", "function", "value", "error",
    "test", "config", "user", "table", "line", "query", "result", "context", "message", "thread", "memory", "disk",
    "build", "client", "module", "class", "method", "field", "string", "option", "branch", "commit", "review",
    "service", "queue", "batch", "window", "layer", "prefix", "latency", "index", "path", "key", "hash", "block",
    "limit", "timeout", "log", "metric", "report", "draft", "plan", "step", "issue", "patch", "release", "budget",
    "meeting", "summary", "example", "reason", "problem", "recipe", "flight", "invoice", "customer", "order", "price",
    "chapter", "poem", "garden", "invoice", "schema", "parser", "widget", "ticket", "sprint", "dataset", "kernel",
)  # fmt: skip
_GLUE = (
    "the", "the", "a", "of", "to", "in", "on", "for", "with", "and", "or", "but", "not", "is", "are", "was", "it",
    "this", "that", "we", "you", "I", "my", "our", "when", "if", "so", "then", "also", "still", "just", "only",
    "very", "more", "before", "after", "why", "how", "what", "don't", "it's", "isn't", "we'll", "you're", "can't",
)  # fmt: skip
_VERBS = (
    "check", "restore", "save", "load", "compare", "explain", "rewrite", "list", "measure", "split", "merge", "send",
    "read", "write", "run", "fix", "skip", "keep", "drop", "add", "remove", "rename", "update", "parse", "render",
)  # fmt: skip
_ADJECTIVES = (
    "slow", "fast", "long", "short", "warm", "cold", "stale", "fresh", "broken", "clean", "large", "small",
    "shared", "exact", "rough", "odd", "same", "different", "new", "old", "NOT", "IMPORTANT",
)  # fmt: skip
_PROPER = (
    "Python", "JSON", "HTTP/2", "macOS", "iOS", "GPU", "PostgreSQL", "llama.cpp", "KV-cache", "OpenAI", "README.md",
    "GitHub", "Kubernetes", "O'Brien", "McAllister", "eBay", "x86_64", "UTF-8", "SSE", "TTFT", "NaN", "iPhone",
    "LaTeX", "WebSocket", "CI/CD", "Dr. Müller", "Mrs. Nakamura", "Q3", "AWS", "YAML",
)  # fmt: skip
_UNICODE = (
    "café", "naïve", "Zürich", "São Paulo", "résumé", "façade", "Ærøskøbing", "Łódź", "cafe\u0301", "man\u0303ana",
    "Straße", "İstanbul", "東京", "缓存命中率", "キャッシュ", "한국어", "Привет, мир", "λόγος", "مرحبا بالعالم",
    "שלום עולם", "हिन्दी", "🚀", "👍🏽", "🧪", "👨\u200d👩\u200d👧", "✅", "→", "≥ 95 %", "½", "…",
)  # fmt: skip
_SHORT = (
    "ok", "Thanks! 🙏", "Continue.", "Why?", "Hmm — are you sure?", "Perfect, merci !", "Sí, gracias.", "Go on.",
    "LGTM ✅", "Can you shorten that?", "and the tests?", "Do it.", "わかりました。", "No, the OTHER one.",
)  # fmt: skip
_PEOPLE = ("alice", "bob", "carla_m", "dev-42", "Ops_Team", "nguyen")
_CITIES = ("Zürich", "São Paulo", "東京", "Kraków", "Reykjavík", "القاهرة", "Montréal")
_DIRS = ("src", "lpcache", "tests/unit", "docs", "app/models", "scripts", "web/static")
_EXTENSIONS = ("py", "md", "json", "ts", "rs", "yaml", "sh")

# The tools a harness picks from: OpenAI function definitions with JSON-schema parameters.
_TOOLS: tuple[tuple[str, str, dict[str, Any], tuple[str, ...]], ...] = (
    ("read_file", "Read a UTF-8 text file from the workspace; returns its lines, numbered.",
     {"path": {"type": "string", "description": "Path relative to the workspace root."},
      "start_line": {"type": "integer", "minimum": 1}, "end_line": {"type": "integer", "minimum": 1}}, ("path",)),
    ("run_shell", "Run a shell command in the project directory; returns the exit code, stdout and stderr.",
     {"command": {"type": "string"}, "timeout_s": {"type": "integer", "default": 60}}, ("command",)),
    ("search_code", "Search the repository with a regular expression (ripgrep syntax).",
     {"pattern": {"type": "string"}, "glob": {"type": "string", "description": "e.g. *.py"},
      "max_results": {"type": "integer", "default": 20}}, ("pattern",)),
    ("edit_file", "Replace one exact occurrence of old_text with new_text in a file.",
     {"path": {"type": "string"}, "old_text": {"type": "string"}, "new_text": {"type": "string"}},
     ("path", "old_text", "new_text")),
    ("web_search", "Search the web; returns titles, URLs and snippets.",
     {"query": {"type": "string"}, "lang": {"type": "string", "enum": ["en", "fr", "de", "ja", "ar"]}}, ("query",)),
    ("get_weather", "Current weather for a city.",
     {"city": {"type": "string"}, "units": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ("city",)),
    ("sql_query", "Run a read-only SQL query against the analytics database.",
     {"sql": {"type": "string"}, "limit": {"type": "integer", "maximum": 1000}}, ("sql",)),
    ("create_ticket", "Open an issue in the tracker.",
     {"title": {"type": "string"}, "body": {"type": "string"},
      "labels": {"type": "array", "items": {"type": "string"}},
      "priority": {"type": "string", "enum": ["low", "normal", "high"]}}, ("title",)),
    ("get_time", "The current date and time in a time zone.",
     {"tz": {"type": "string", "description": "IANA name, e.g. Europe/Paris"}}, ("tz",)),
)  # fmt: skip


def _tool(index: int) -> dict[str, Any]:
    name, description, properties, required = _TOOLS[index]
    parameters = {"type": "object", "properties": copy.deepcopy(properties), "required": list(required)}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def count_words(text: str) -> int:
    """The number of `\\w+` runs in the text (what the sizes of this module count)."""
    return len(_WORD.findall(text))


# ---- text ----------------------------------------------------------------------------------------------------------


def _number(rng: random.Random) -> str:
    a, b, c = rng.randint(1, 12), rng.randint(1, 28), rng.randint(0, 99)
    return rng.choice((
        str(rng.randint(2, 999)), f"{a}.{c:02d}", f"v{a % 4}.{b}.{c % 10}", f"{b * 2} GB", f"{c}%", "1,024",
        f"2024-{a:02d}-{b:02d}", f"#{rng.randint(100, 9999)}", f"0x{rng.randrange(16**4):04x}",
    ))  # fmt: skip


def sentence(rng: random.Random, unicode: bool = True) -> str:
    """One sentence: mixed case, commas, quotes, numbers, contractions, names and (if unicode) non-ASCII words."""
    out: list[str] = []
    for i in range(rng.randint(5, 16)):
        r = rng.random()
        if r < 0.08:
            word = rng.choice(_PROPER)
        elif r < 0.14 and unicode:
            word = rng.choice(_UNICODE)
        elif r < 0.19:
            word = _number(rng)
        else:
            word = rng.choice(rng.choice((_NOUNS, _GLUE, _GLUE, _VERBS, _ADJECTIVES)))
        if i and rng.random() < 0.05:
            word = rng.choice(('"{}"', "({})", "`{}`", "«{}»", "'{}'")).format(word)
        if i and rng.random() < 0.12:
            out[-1] += rng.choice((",", ",", ",", ";", ":", " —"))
        out.append(word)
    first = out[0]
    out[0] = first[0].upper() + first[1:]
    return " ".join(out) + rng.choice((".", ".", ".", ".", "?", "!", "...", "…", "?!"))


def _paragraph(rng: random.Random, n_words: int) -> str:
    out = [sentence(rng)]
    while count_words(" ".join(out)) < n_words:
        out.append(sentence(rng))
    return " ".join(out)


def _bullets(rng: random.Random) -> str:
    mark = rng.choice(("- ", "* ", "1. ", "- [ ] "))
    items = [mark + sentence(rng)[:-1] for _ in range(rng.randint(2, 5))]
    if rng.random() < 0.4:
        items.insert(1, "  - " + sentence(rng, unicode=False))
    return "\n".join(items)


def _table(rng: random.Random) -> str:
    columns = rng.sample(("Name", "Value", "Notes", "p95 (ms)", "État", "Owner", "✓"), rng.randint(3, 4))
    rows = ["| " + " | ".join(columns) + " |", "|" + "|".join(["---:"] + ["---"] * (len(columns) - 1)) + "|"]
    for _ in range(rng.randint(2, 5)):
        pools = (_NOUNS, _UNICODE, _PROPER)
        cells = [_number(rng) if rng.random() < 0.25 else rng.choice(rng.choice(pools)) for _ in columns]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _python(rng: random.Random) -> str:
    name, arg = f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}", rng.choice(_NOUNS)
    cls = rng.choice(_NOUNS).capitalize() + rng.choice(("Store", "Cache", "Client", "Index"))
    return (
        f"```python\nclass {cls}:\n    \"\"\"{sentence(rng, unicode=False)}\"\"\"\n\n"
        f"    def {name}(self, {arg}: str, *, limit: int = {rng.randint(2, 512)}) -> dict[str, int]:\n"
        f"        # TODO({rng.choice(_PEOPLE)}): {sentence(rng)}\n"
        f"        counts: dict[str, int] = {{}}\n        for line in {arg}.splitlines():\n"
        f"            key = line.strip().lower()\n            if key and len(counts) < limit:\n"
        f"                counts[key] = counts.get(key, 0) + 1\n        return counts\n```"
    )


def _json_block(rng: random.Random) -> str:
    data: dict[str, Any] = {
        rng.choice(_NOUNS): rng.choice((rng.randint(0, 9999), rng.choice(_UNICODE), None, True)) for _ in range(3)
    }
    data["items"] = [{"id": rng.randint(1, 99), "label": sentence(rng)[:40]} for _ in range(rng.randint(1, 3))]
    return "```json\n" + json.dumps(data, indent=2, ensure_ascii=False) + "\n```"


def _shell(rng: random.Random) -> str:
    word, path = rng.choice(_NOUNS), _path(rng)
    lines = rng.sample((
        f'$ grep -rn "{word}" {rng.choice(_DIRS)}/ | head -3', f"{path}:{rng.randint(1, 400)}:    {word} = None",
        "$ curl -s http://127.0.0.1:8081/v1/models | jq '.data[0].id'", '"llama.cpp"',
        f"$ python -m pytest -q -k {word}", f"{rng.randint(1, 90)} passed, {rng.randint(0, 3)} failed in 3.4s",
        f"$ git log --oneline -2 -- {path}", f"{rng.randrange(16**7):07x} Fix the {word} ({rng.choice(_PEOPLE)})",
    ), rng.randint(3, 6))  # fmt: skip
    return "```bash\n" + "\n".join(lines) + "\n```"


def _path(rng: random.Random) -> str:
    return f"{rng.choice(_DIRS)}/{rng.choice(_NOUNS)}_{rng.choice(_NOUNS)}.{rng.choice(_EXTENSIONS)}"


_SEGMENTS: tuple[tuple[int, Callable[[random.Random], str]], ...] = (
    (6, lambda rng: _paragraph(rng, rng.randint(20, 70))),
    (2, _bullets),
    (1, _table),
    (1, _python),
    (1, _json_block),
    (1, _shell),
    (1, lambda rng: "## " + " ".join(w.capitalize() for w in rng.sample(_NOUNS, rng.randint(2, 4)))),
    (1, lambda rng: "> " + sentence(rng)),
)
_SEGMENT_WEIGHTS = [w for w, _ in _SEGMENTS]


def text(rng: random.Random, n_words: int) -> str:
    """Markdown of about n_words words: paragraphs, lists, tables, code blocks (python, JSON, shell), quotes.
    Below 6 words, a short reply ("Thanks! 🙏", "Why?")."""
    if n_words < 6:
        return rng.choice(_SHORT)
    out: list[str] = []
    total = 0
    while total < n_words:
        segment = rng.choices(_SEGMENTS, _SEGMENT_WEIGHTS)[0][1](rng)
        if total + count_words(segment) > 1.3 * n_words and count_words(segment) > 12:
            segment = _paragraph(rng, max(1, n_words - total))
        out.append(segment)
        total += count_words(segment)
    return "\n\n".join(out)


def assistant_text(seed: int, n_words: int = 80) -> str:
    """A deterministic assistant answer of about n_words words, for conversations that need no server."""
    return text(random.Random(f"answer:{seed}"), n_words)


# ---- images --------------------------------------------------------------------------------------------------------


def png(seed: int, size: int = 2) -> bytes:
    """A valid size x size RGB PNG whose pixels come from the seed (stored deflate: the same bytes everywhere)."""
    rng = random.Random(f"png:{seed}")
    raw = b"".join(b"\x00" + bytes(rng.randrange(256) for _ in range(3 * size)) for _ in range(size))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    header = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 0)) + chunk(b"IEND", b"")


def image_part(seed: int) -> dict[str, Any]:
    """An `image_url` content part holding `png(seed)` as a data URL."""
    url = "data:image/png;base64," + base64.b64encode(png(seed)).decode()
    return {"type": "image_url", "image_url": {"url": url}}


# ---- harness, tool calls -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Harness:
    """One client program: the system prompt and tools every one of its conversations starts with."""

    name: str
    model: str
    system: str
    tools: tuple[dict[str, Any], ...]

    def tools_json(self) -> list[dict[str, Any]]:
        return copy.deepcopy(list(self.tools))


def harness(seed: int, n_chars: int = 3000, n_tools: int = 5, model: str = "llama.cpp") -> Harness:
    """A harness with a system prompt of about n_chars characters (markdown: rules, a table, code) and n_tools
    tools (0 to 8); the tools' JSON adds about 250 characters each."""
    rng = random.Random(f"harness:{seed}")
    name = rng.choice(("Cody", "Ada", "Hermes", "Kiri", "Zoë")) + "-" + str(rng.randint(1, 9))
    parts = [
        f"You are {name}, a careful assistant running inside {rng.choice(_PROPER)} for {rng.choice(_PEOPLE)}. "
        + sentence(rng),
        "# Rules\n" + _bullets(rng) + "\n" + _bullets(rng),
    ]
    while sum(len(p) for p in parts) < n_chars:
        parts.append(rng.choice((
            lambda: "## " + rng.choice(_NOUNS).capitalize() + "\n" + _paragraph(rng, 40), lambda: _bullets(rng),
            lambda: _table(rng), lambda: _python(rng), lambda: _json_block(rng),
        ))())  # fmt: skip
    tools = tuple(_tool(i) for i in sorted(rng.sample(range(len(_TOOLS) - 1), min(n_tools, len(_TOOLS) - 1))))
    return Harness(name, model, "\n\n".join(parts), tools)


def _argument(rng: random.Random, key: str, schema: dict[str, Any]) -> Any:
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema.get("type")
    if kind == "integer":
        return rng.randint(1, 200)
    if kind == "array":
        return rng.sample(_NOUNS, rng.randint(1, 3))
    return {
        "path": _path, "city": lambda r: r.choice(_CITIES), "tz": lambda r: r.choice(("Europe/Paris", "Asia/Tokyo")),
        "command": lambda r: r.choice((f"ls -la {r.choice(_DIRS)}", f"python -m pytest -q -k {r.choice(_NOUNS)}",
                                       f"grep -c '{r.choice(_NOUNS)}' {_path(r)}")),
        "pattern": lambda r: rf"def \w+_{r.choice(_NOUNS)}\(",
        "sql": lambda r: f"SELECT {r.choice(_NOUNS)}, count(*) FROM {r.choice(_NOUNS)}s GROUP BY 1 ORDER BY 2 DESC",
        "glob": lambda r: "*." + r.choice(_EXTENSIONS),
    }.get(key, lambda r: sentence(r)[: r.randint(20, 80)])(rng)


def _tool_call(rng: random.Random, tool: dict[str, Any]) -> dict[str, Any]:
    function = tool["function"]
    properties = function["parameters"]["properties"]
    keys = [k for k in properties if k in function["parameters"]["required"] or rng.random() < 0.5]
    arguments = {k: _argument(rng, k, properties[k]) for k in keys}
    call_id = "call_" + "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZabcdefghjkmnpqrstuvwxyz2345678") for _ in range(24))
    return {"id": call_id, "type": "function",
            "function": {"name": function["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _tool_result(rng: random.Random, name: str, n_words: int) -> str:
    """What a tool returns: numbered file lines, shell output, or JSON."""
    if name == "read_file":
        lines = "\n".join(_python(rng).splitlines()[1:-1] + [f"# {sentence(rng)}" for _ in range(n_words // 12)])
        return "\n".join(f"{i:>4}\t{line}" for i, line in enumerate(lines.splitlines(), 1))
    if name == "run_shell":
        body = _shell(rng)[8:-4] + "\n" + "\n".join(sentence(rng, unicode=False) for _ in range(n_words // 12))
        return f"exit code: {rng.choice((0, 0, 1))}\nstdout:\n{body}\nstderr:\n"
    items = [{"rank": i + 1, "title": sentence(rng)[:60], "score": round(rng.random(), 3)}
             for i in range(max(1, n_words // 14))]
    return json.dumps({"ok": True, "tool": name, "results": items}, ensure_ascii=False)


# ---- conversations -------------------------------------------------------------------------------------------------


def placeholder(turn: int) -> str:
    """The assistant content standing for the answer to request `turn` until the caller has the real one."""
    return f"<<answer {turn}>>"


def fill_answer(bodies: Sequence[Body], turn: int, answer: str) -> list[Body]:
    """Copies of the bodies with `placeholder(turn)` replaced by the real answer."""
    out = copy.deepcopy(list(bodies))
    for body in out:
        for message in body["messages"]:
            if message.get("role") == "assistant" and message.get("content") == placeholder(turn):
                message["content"] = answer
    return out


class Conversation:
    """One conversation, request by request: `body` is the current request, `advance(answer)` the next one.

    n_words is about the words the conversation itself writes over all its turns (a second system message with the
    environment, from 80 words on; the user messages; the tool results); the harness's system prompt and the
    assistant's answers come on top. tool_rate is the share of turns answered by tool calls (with a harness that
    has tools); names puts a `name` on some user messages; images an image part in some; parts gives some user
    messages an array of parts instead of a string. Which turns call tools, and every text, depend on the seed
    only, never on the answers given.
    """

    def __init__(self, seed: int, harness: Harness | None = None, *, turns: int = 4, n_words: int = 400,
                 tool_rate: float = 0.4, names: bool = True, images: bool = False, parts: bool = True) -> None:
        if turns < 1:
            raise ValueError("turns must be at least 1")
        self._rng = rng = random.Random(f"conversation:{seed}")
        self._harness, self._names, self._images, self._parts = harness, names, images, parts
        has_tools = harness is not None and bool(harness.tools)
        self._tool_turns = [has_tools and rng.random() < tool_rate for _ in range(turns - 1)]
        weights = [rng.choice((0.1, 0.4, 1.0, 1.0, 1.5, 3.0)) for _ in range(turns)]
        system_words = min(40, n_words // 8) if n_words >= 80 else 0
        self._budget = [max(1, round((n_words - system_words) * w / sum(weights))) for w in weights]
        self.turn = 0
        self.messages: list[Message] = []
        if harness is not None:
            self.messages.append({"role": "system", "content": harness.system})
        if system_words:
            self.messages.append({"role": "system", "content": self._environment(system_words)})
        self.messages.append(self._user(self._budget[0]))

    def _environment(self, n_words: int) -> str:
        rng = self._rng
        env = (f"# Environment\n- date: 2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}\n"
               f"- cwd: /home/{rng.choice(_PEOPLE)}/src/{rng.choice(_NOUNS)}\n- locale: "
               f"{rng.choice(('fr_FR', 'ja_JP', 'en_US', 'ar_EG'))}.UTF-8\n")
        return env + _paragraph(rng, max(1, n_words - 12))

    @property
    def next_is_tool(self) -> bool:
        """Whether the answer to the current request is a tool call (then `advance` ignores the answer text)."""
        return self.turn < len(self._tool_turns) and self._tool_turns[self.turn]

    @property
    def body(self) -> Body:
        """The current request (a copy: changing it changes nothing here)."""
        body: Body = {"model": self._harness.model if self._harness else "llama.cpp",
                      "messages": copy.deepcopy(self.messages)}
        if self._harness is not None and self._harness.tools:
            body["tools"] = self._harness.tools_json()
        return body

    def advance(self, answer: str | None = None) -> Body:
        """Add the answer to the current request (`placeholder(turn)` if None) and the next user message; or, on a
        tool turn, the assistant's tool call(s) and their results. Returns the next request."""
        if self.turn >= len(self._tool_turns):
            raise IndexError("the conversation has no more turns")
        rng = self._rng
        n_words = self._budget[self.turn + 1]
        if self._tool_turns[self.turn]:
            assert self._harness is not None
            tools = rng.sample(self._harness.tools, 2 if rng.random() < 0.2 else 1)
            calls = [_tool_call(rng, t) for t in tools]
            preface = rng.choice((None, None, None, "Let me check that first."))
            self.messages.append({"role": "assistant", "content": preface, "tool_calls": calls})
            for call in calls:
                name = call["function"]["name"]
                result: Message = {"role": "tool", "tool_call_id": call["id"],
                                   "content": _tool_result(rng, name, n_words // len(calls))}
                if rng.random() < 0.5:
                    result["name"] = name
                self.messages.append(result)
        else:
            self.messages.append({"role": "assistant", "content": placeholder(self.turn) if answer is None else answer})
            self.messages.append(self._user(n_words))
        self.turn += 1
        return self.body

    def _user(self, n_words: int) -> Message:
        rng = self._rng
        message: Message = {"role": "user", "content": text(rng, n_words)}
        if self._names and rng.random() < 0.3:
            message["name"] = rng.choice(_PEOPLE)
        with_image = self._images and rng.random() < 0.5
        if with_image or (self._parts and rng.random() < 0.3):
            content: list[dict[str, Any]] = [{"type": "text", "text": message["content"]}]
            if with_image:
                content.append(image_part(rng.randrange(2**31)))
            if rng.random() < 0.5:
                content.append({"type": "text", "text": f"<environment_details>\nOpen tabs: {_path(rng)}, "
                                                        f"{_path(rng)}\n</environment_details>"})
            message["content"] = content
        return message


def conversation(seed: int, harness: Harness | None = None, *, turns: int = 4, n_words: int = 400,
                 answers: Sequence[str] | None = None, **options: Any) -> list[Body]:
    """The `turns` successive request bodies of one conversation (options: see `Conversation`). answers[i] is the
    assistant's text answer to request i; without answers, `placeholder(i)` stands for it (`fill_answer` replaces
    it). On a tool turn the generated tool call is the answer and answers[i] is not used."""
    conv = Conversation(seed, harness, turns=turns, n_words=n_words, **options)
    bodies = [conv.body]
    for i in range(turns - 1):
        bodies.append(conv.advance(answers[i] if answers is not None else None))
    return bodies


def _content_words(messages: Sequence[Message]) -> int:
    texts: list[str] = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return sum(count_words(t) for t in texts)


def request(seed: int, n_words: int, harness: Harness | None = None, *, turns: int = 1, **options: Any) -> Body:
    """One request whose message contents hold at least n_words words, and not many more unless the harness's
    system prompt alone is longer: the last of a `turns`-request conversation with generated answers, its last
    user message lengthened to reach n_words."""
    share = max(1, n_words - (count_words(harness.system) if harness else 0))
    conv = Conversation(seed, harness, turns=turns, n_words=max(1, share // 2), **options)
    for i in range(turns - 1):
        conv.advance(assistant_text(seed * 1000 + i, share // (2 * turns)))
    body = conv.body
    last = next(m for m in reversed(body["messages"]) if m["role"] == "user")
    rng = random.Random(f"request:{seed}")
    missing = n_words - _content_words(body["messages"])
    if missing > 0:
        extra = "\n\n" + _paragraph(rng, missing)
        if isinstance(last["content"], str):
            last["content"] += extra
        else:
            last["content"][0]["text"] += extra
    return body


# ---- near-duplicates -----------------------------------------------------------------------------------------------

KINDS: dict[str, str] = {
    "case": "the case of 1-3 ASCII words in one message's text (raw prefix changes, its lower-cased words do not)",
    "punctuation": "1-3 punctuation marks of one message's text (raw prefix changes, its words do not)",
    "role": "one message's role: the last of several system messages sent as user, or else the first user message "
            "sent as system",
    "tool_added": "one tool appended to `tools` (a `tools` array is added if there was none)",
    "tool_description": "one tool's description reworded: the tool's own words change, no message does",
    "tool_arguments": "one value in the arguments of the last tool call",
    "name": "the `name` of the last user message: added, or changed",
    "image": "the pixels (so the data URL) of the last image part",
}
"""What each variant kind changes. Every kind keeps the lower-cased `\\w+` words of the raw prefix (message contents,
`prefix.raw_prefix`); all but `SAME_TEXT_ONLY_WORDS` keep the raw prefix itself."""
SAME_TEXT_ONLY_WORDS = frozenset({"case", "punctuation"})

_ASCII_WORD = re.compile(r"(?<!\w)[A-Za-z]{3,}(?!\w)")
_PUNCT = re.compile(r"[,;:.!?](?=\s|$)")
_SWAP = {",": ";", ";": ",", ":": " —", ".": "!", "!": ".", "?": "?!"}


def _text_slots(message: Message) -> list[tuple[Any, Any]]:
    """(container, key) of each text in a message's content."""
    content = message.get("content")
    if isinstance(content, str):
        return [(message, "content")]
    if isinstance(content, list):
        return [(p, "text") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return []


def _edit_text(messages: list[Message], index: int | None, pattern: re.Pattern[str], change: Callable[[str], str],
               rng: random.Random, fallback: Callable[[str], str] | None = None) -> None:
    """Change up to 3 matches of pattern in one text: of message `index`, else of the last user message that has a
    match, else of any message; with no match anywhere, apply `fallback` to the first of those texts."""
    order = [index] if index is not None else [
        i for i in reversed(range(len(messages))) if messages[i].get("role") == "user"
    ] + list(range(len(messages)))
    slots = [slot for i in order for slot in _text_slots(messages[i])]
    for container, key in slots:
        found = list(pattern.finditer(container[key]))
        if found:
            s = container[key]
            for m in sorted(rng.sample(found, min(3, len(found))), key=lambda m: m.start(), reverse=True):
                s = s[: m.start()] + change(m.group()) + s[m.end() :]
            container[key] = s
            return
    if fallback is None or not slots:
        raise ValueError("no message text to change")
    container, key = slots[0]
    container[key] = fallback(container[key])


def _recase(word: str) -> str:
    return word.lower() if word[0].isupper() else word.upper() if word[1:].islower() else word.capitalize()


def variant(body: Body, kind: str, seed: int = 0, index: int | None = None) -> Body:
    """A copy of the body that differs only as `KINDS[kind]` says. `index` picks the message for case, punctuation
    and role. Raises ValueError when the body has nothing of that kind (no tool call, no image, ...)."""
    rng = random.Random(f"variant:{kind}:{seed}")
    out = copy.deepcopy(body)
    messages: list[Message] = out["messages"]
    if kind == "case":
        _edit_text(messages, index, _ASCII_WORD, _recase, rng)
    elif kind == "punctuation":
        _edit_text(messages, index, _PUNCT, lambda p: _SWAP[p], rng, lambda s: s + "!")
    elif kind == "role":
        systems = [i for i, m in enumerate(messages) if m.get("role") == "system"]
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        i = index if index is not None else systems[-1] if len(systems) > 1 else users[0] if users else None
        if i is None or messages[i].get("role") not in ("system", "user"):
            raise ValueError("no system or user message to change")
        messages[i]["role"] = "user" if messages[i]["role"] == "system" else "system"
    elif kind == "tool_added":
        tools = out.setdefault("tools", [])
        names = {t["function"]["name"] for t in tools}
        tools.append(next(_tool(i) for i in range(len(_TOOLS)) if _TOOLS[i][0] not in names))
    elif kind == "tool_description":
        if not out.get("tools"):
            raise ValueError("the body has no tools")
        function = rng.choice(out["tools"])["function"]
        function["description"] = function.get("description", "") + " Prefer it over guessing."
    elif kind == "tool_arguments":
        calls = [c for m in messages if m.get("role") == "assistant" for c in m.get("tool_calls") or []]
        if not calls:
            raise ValueError("the body has no tool call")
        function = calls[-1]["function"]
        arguments = json.loads(function["arguments"])
        key = next((k for k, v in arguments.items() if isinstance(v, int)), None)
        if key is not None:
            arguments[key] += 1
        else:
            key = next(k for k, v in arguments.items() if isinstance(v, str))
            arguments[key] += " --verbose" if key == "command" else "_v2"
        function["arguments"] = json.dumps(arguments, ensure_ascii=False)
    elif kind == "name":
        message = next((m for m in reversed(messages) if m.get("role") == "user"), None)
        if message is None:
            raise ValueError("the body has no user message")
        message["name"] = next(n for n in _PEOPLE if n != message.get("name"))
    elif kind == "image":
        parts = [p for m in messages if isinstance(m.get("content"), list) for p in m["content"]
                 if isinstance(p, dict) and p.get("type") == "image_url"]
        if not parts:
            raise ValueError("the body has no image part")
        old = parts[-1]["image_url"]["url"]
        parts[-1]["image_url"] = next(p["image_url"] for s in range(seed, seed + 9)
                                      if (p := image_part(s + 7919))["image_url"]["url"] != old)
    else:
        raise ValueError(f"unknown variant kind {kind!r}; one of {', '.join(KINDS)}")
    return out


def variants(body: Body, seed: int = 0) -> dict[str, Body]:
    """Every variant kind the body allows, by kind."""
    out = {}
    for kind in KINDS:
        try:
            out[kind] = variant(body, kind, seed)
        except ValueError:
            continue
    return out
