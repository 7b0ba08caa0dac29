"""nlohmann's dump(), as llama-server writes JSON: the expected strings were printed by the vendored
nlohmann/json.hpp of build 11434 (`ordered_json::parse(line).dump()`)."""

from __future__ import annotations

import orjson
import pytest

from lpcache.apis.llama_json import dump_float, dumps

# Grisu2 is not always shortest: the last five are where it and Python's repr differ.
FLOATS = [
    ("0.0", "0.0"), ("-0.0", "-0.0"), ("1.0", "1.0"), ("100.0", "100.0"), ("1e15", "1e+15"), ("1e16", "1e+16"),
    ("1e-4", "0.0001"), ("1e-5", "1e-05"), ("123456789012345.0", "123456789012345.0"),
    ("1234567890123456.0", "1.234567890123456e+15"), ("0.1", "0.1"), ("5e-324", "5e-324"),
    ("1.7976931348623157e308", "1.7976931348623157e+308"), ("1e21", "1e+21"), ("2.5", "2.5"), ("-1e100", "-1e+100"),
    ("0.30000000000000004", "0.30000000000000004"), ("12.5e-3", "0.0125"), ("3.14159", "3.14159"),
    ("2.2250738585072014e-308", "2.2250738585072014e-308"),
    ("6.3666589e+19", "6.3666588999999996e+19"), ("2.454673e+20", "2.4546729999999998e+20"),
    ("6.52e+22", "6.5200000000000004e+22"), ("4.492466484580706e+16", "4.4924664845807056e+16"),
    ("-4.2874017110381797e-156", "-4.2874017110381796e-156"),
]


@pytest.mark.parametrize(("text", "nlohmann"), FLOATS)
def test_floats_are_written_as_nlohmann_writes_them(text: str, nlohmann: str) -> None:
    assert dumps(orjson.loads(text)) == nlohmann


def test_a_float_that_is_not_finite_is_null() -> None:
    assert dump_float(float("inf")) == "null"
    assert dump_float(float("nan")) == "null"


@pytest.mark.parametrize(("text", "nlohmann"), [
    ('{"b":1,"a":[1,2.5,-0.0],"c":{"z":null,"y":true,"x":false}}',
     '{"b":1,"a":[1,2.5,-0.0],"c":{"z":null,"y":true,"x":false}}'),
    (r'"\u0000\u0001\u001f\u007f\u0080\u00e9\u2028\ud83d\ude00\"\\\/\b\f\n\r\t"',
     '"\\u0000\\u0001\\u001f\x7f\x80é\u2028😀\\"\\\\/\\b\\f\\n\\r\\t"'),
    ("[18446744073709551615,-9223372036854775808,123456789012345678901234,-9223372036854775809,1E2,0.5e-7]",
     "[18446744073709551615,-9223372036854775808,1.2345678901234569e+23,-9.223372036854776e+18,100.0,5e-08]"),
    ('{"a":1,"a":2,"b":3}', '{"a":2,"b":3}'),
    ('{"é":"ü","日本":"語"}', '{"é":"ü","日本":"語"}'),
    ("[[],{},[{}]]", "[[],{},[{}]]"),
])
def test_values_are_written_as_nlohmann_writes_them(text: str, nlohmann: str) -> None:
    assert dumps(orjson.loads(text)) == nlohmann


def test_python_ints_beyond_64_bits_are_written_as_the_double_nlohmann_would_parse() -> None:
    assert dumps([2**64, -2**63 - 1]) == "[1.8446744073709552e+19,-9.223372036854776e+18]"


def test_what_is_not_json_is_refused() -> None:
    with pytest.raises(TypeError):
        dumps({"a": {1, 2}})
