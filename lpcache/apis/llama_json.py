"""JSON as llama-server writes it: nlohmann's `ordered_json::dump()`, byte for byte.

Keys stay in their order, the output is compact, non-ASCII is written as UTF-8 and control characters as `\\b`,
`\\f`, `\\n`, `\\r`, `\\t` or `\\u00xx`: orjson writes all that the same. Floats differ: nlohmann writes the digits of
its Grisu2 (shortest in most cases, not all: 6.3666589e+19 is `6.3666588999999996e+19`) in printf `%g`'s layout with
`.0` added to integers and a two-digit exponent (`100.0`, `1e+16`, `1e-05`). `dumps` ports both, so that a value
llama-server dumps (a tool_use's input becomes a chat tool call's arguments) is the same string here.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction
from typing import Any

import orjson

_M64 = (1 << 64) - 1


def json_value(obj: Any, key: str, default: Any) -> Any:
    """llama-server's `json_value`: the field if it is there and not null, converted as nlohmann converts it to the
    default's type (any JSON for an object or array default; a number or a boolean for an integer, truncated);
    else, or when it does not convert, the default."""
    found = obj.get(key) if isinstance(obj, dict) else None
    if found is None or isinstance(default, dict | list):
        return default if found is None else found
    if isinstance(default, bool):
        return found if isinstance(found, bool) else default
    if isinstance(default, int):
        return int(found) if isinstance(found, int) or (isinstance(found, float) and math.isfinite(found)) \
            else default
    if isinstance(default, str):
        return found if isinstance(found, str) else default
    return found


def dumps(value: Any) -> str:
    """`value` (what orjson parses to) as nlohmann's `dump()` writes it."""
    out: list[str] = []
    _dump(value, out)
    return "".join(out)


def _dump(value: Any, out: list[str]) -> None:
    if value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, str):
        out.append(orjson.dumps(value).decode())
    elif isinstance(value, int):
        out.append(str(value) if -2**63 <= value < 2**64 else dump_float(float(value)))
    elif isinstance(value, float):
        out.append(dump_float(value))
    elif isinstance(value, dict):
        out.append("{")
        for i, (key, item) in enumerate(value.items()):
            if i:
                out.append(",")
            out.append(orjson.dumps(key).decode())
            out.append(":")
            _dump(item, out)
        out.append("}")
    elif isinstance(value, list | tuple):
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _dump(item, out)
        out.append("]")
    else:
        raise TypeError(f"not a JSON value: {type(value).__name__}")


def dump_float(x: float) -> str:
    """nlohmann's `to_chars`: Grisu2's digits, fixed notation while the exponent is in -4..15."""
    if not math.isfinite(x):
        return "null"
    if x == 0:
        return "-0.0" if math.copysign(1.0, x) < 0 else "0.0"
    digits, exponent = _grisu2(abs(x))
    k = len(digits)
    n = k + exponent   # the value is 0.digits * 10^n
    if k <= n <= 15:
        text = digits + "0" * (n - k) + ".0"
    elif 0 < n <= 15:
        text = digits[:n] + "." + digits[n:]
    elif -4 < n <= 0:
        text = "0." + "0" * -n + digits
    else:
        e = n - 1
        text = (digits if k == 1 else digits[0] + "." + digits[1:]) + ("e-" if e < 0 else "e+") + f"{abs(e):02d}"
    return ("-" if x < 0 else "") + text


# Grisu2 as nlohmann's dtoa_impl has it: (f, e) pairs are f * 2^e, f an unsigned 64-bit integer.

def _cached_powers() -> list[tuple[int, int, int]]:
    """10^k for k = -300, -292, ... 324 as normalised 64-bit significands, rounded to nearest (kCachedPowers)."""
    powers = []
    for k in range(-300, 325, 8):
        exact = Fraction(10) ** k
        e = exact.numerator.bit_length() - exact.denominator.bit_length() - 64
        while exact / Fraction(2) ** e >= 2**64:
            e += 1
        while exact / Fraction(2) ** e < 2**63:
            e -= 1
        f = round(exact / Fraction(2) ** e)
        if f == 2**64:
            f, e = 2**63, e + 1
        powers.append((f, e, k))
    return powers


_POWERS = _cached_powers()


def _normalize(f: int, e: int) -> tuple[int, int]:
    shift = 64 - f.bit_length()
    return f << shift, e - shift


def _mul(x: tuple[int, int], y: tuple[int, int]) -> tuple[int, int]:
    """The upper 64 bits of the product, rounded half up (`diyfp::mul`)."""
    return (x[0] * y[0] + (1 << 63)) >> 64, x[1] + y[1] + 64


def _grisu2(value: float) -> tuple[str, int]:
    """The digits and decimal exponent of a positive finite double: value ~ int(digits) * 10^exponent."""
    bits = struct.unpack("<Q", struct.pack("<d", value))[0]
    biased, fraction = bits >> 52, bits & ((1 << 52) - 1)
    v = (fraction, -1074) if biased == 0 else (fraction + (1 << 52), biased - 1075)
    plus = _normalize(2 * v[0] + 1, v[1] - 1)
    lower = (4 * v[0] - 1, v[1] - 2) if fraction == 0 and biased > 1 else (2 * v[0] - 1, v[1] - 1)
    minus = (lower[0] << (lower[1] - plus[1]), plus[1])
    w = _normalize(*v)

    f = -60 - plus[1] - 1
    k = abs(f * 78913) >> 18
    k = (-k if f < 0 else k) + (1 if f > 0 else 0)   # C's division truncates
    c_f, c_e, c_k = _POWERS[(300 + k + 7) // 8]
    w = _mul(w, (c_f, c_e))
    w_minus = _mul(minus, (c_f, c_e))
    w_plus = _mul(plus, (c_f, c_e))
    return _digit_gen((w_minus[0] + 1, w_minus[1]), w, (w_plus[0] - 1, w_plus[1]), -c_k)


def _digit_gen(m_minus: tuple[int, int], w: tuple[int, int], m_plus: tuple[int, int],
               exponent: int) -> tuple[str, int]:
    delta = (m_plus[0] - m_minus[0]) & _M64
    dist = (m_plus[0] - w[0]) & _M64
    shift = -m_plus[1]
    one = 1 << shift
    p1, p2 = m_plus[0] >> shift, m_plus[0] & (one - 1)
    buf: list[int] = []
    n = len(str(p1)) if p1 else 1
    pow10 = 10 ** (n - 1)
    while n > 0:
        digit, p1 = divmod(p1, pow10)
        buf.append(digit)
        n -= 1
        rest = ((p1 << shift) + p2) & _M64
        if rest <= delta:
            _round(buf, dist, delta, rest, (pow10 << shift) & _M64)
            return "".join(map(str, buf)), exponent + n
        pow10 //= 10
    m = 0
    while True:
        p2 = (p2 * 10) & _M64
        buf.append(p2 >> shift)
        p2 &= one - 1
        m += 1
        delta = (delta * 10) & _M64
        dist = (dist * 10) & _M64
        if p2 <= delta:
            break
    _round(buf, dist, delta, p2, one)
    return "".join(map(str, buf)), exponent - m


def _round(buf: list[int], dist: int, delta: int, rest: int, ten_k: int) -> None:
    while rest < dist and delta - rest >= ten_k and (
            rest + ten_k < dist or dist - rest > rest + ten_k - dist):
        buf[-1] -= 1
        rest += ten_k
