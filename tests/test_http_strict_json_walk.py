"""The strict JSON check after the parse: a body's size bounds (its `ids` count) are checked before
any walk of its values, the walk looks one by one only at values that can be wrong (a list of plain
strings costs one pass in C), and it refuses exactly what a check of every value would."""

from __future__ import annotations

import json
import math
import sys

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.http_server import TOKEN, RunningServer, http_config

from harvester.services.http.params import body_bound
from harvester.services.http.problems import ProblemException
from harvester.services.http.strict_json import NESTING_MAX, UnreadableBody, _constant, _integer, _NotJSON, loads

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _refused_by_looking_at_everything(value: object, depth: int = 0) -> bool:
    """What the strict check must refuse, by the plainest walk of every value."""
    if isinstance(value, dict | list) and depth == NESTING_MAX:
        return True
    if isinstance(value, _NotJSON):
        return True
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, str):
        return any(c == "\x00" or "\ud800" <= c <= "\udfff" for c in value)
    if isinstance(value, dict):
        return any(_refused_by_looking_at_everything(k, depth) for k in value) or any(
            _refused_by_looking_at_everything(v, depth + 1) for v in value.values()
        )
    if isinstance(value, list):
        return any(_refused_by_looking_at_everything(v, depth + 1) for v in value)
    return False


_texts = st.text(alphabet=st.sampled_from(["a", "é", "\x00", "\ud800", "\udfff", "😀", "\\", "u", "0"]), max_size=6)
_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | _texts
    | st.just("OVERFLOW")  # a number too large for a double, written in the text below
)
_values = st.recursive(
    _scalars, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(_texts, inner, max_size=4), max_leaves=30
)


@settings(max_examples=400, deadline=None)
@given(_values, st.booleans())
def test_the_check_refuses_exactly_what_looking_at_every_value_refuses(value, ascii_only):
    try:
        text = json.dumps(value, ensure_ascii=ascii_only).replace('"OVERFLOW"', "1e999")
        body = text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate written raw: not UTF-8, refused before any walk
        text = json.dumps(value, ensure_ascii=True).replace('"OVERFLOW"', "1e999")
        body = text.encode("utf-8")
    parsed = json.loads(text, parse_constant=_constant, parse_int=_integer)
    expected = _refused_by_looking_at_everything(parsed)
    try:
        loads(body)
        refused = False
    except UnreadableBody:
        refused = True
    assert refused == expected, text


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('{"ids": ["a", "b\\u0000"]}', "body.ids[1]"),
        ('{"ids": ["a", 1, "\\udc00x"]}', "body.ids[2]"),
        ('{"x": [1, 2, 1e999]}', "body.x[2]"),
        ('{"x": {"y": [NaN]}}', "body.x.y[0]"),
        ("[" * (NESTING_MAX + 1) + "1" + "]" * (NESTING_MAX + 1), "body" + "[0]" * NESTING_MAX),
    ],
)
def test_a_refusal_still_names_the_field_at_fault(text, field):
    with pytest.raises(UnreadableBody) as exc:
        loads(text.encode())
    assert exc.value.field == field


def test_a_list_of_plain_strings_is_not_looked_at_one_string_at_a_time():
    body = json.dumps({"ids": [f"1:0:{i}" for i in range(200_000)]}).encode()
    calls = 0

    def count(_frame: object, event: str, _arg: object) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(count)
    try:
        loads(body)
    finally:
        sys.setprofile(None)
    assert calls < 1000, f"{calls} Python and C calls for one list of 200,000 strings"


def test_too_many_ids_are_refused_before_any_value_is_looked_at():
    bound = body_bound(10)
    body = ('{"ids": [' + ", ".join(['"1:0:0"'] * 10) + ', "\\u0000"]}').encode()
    with pytest.raises(ProblemException) as exc:
        loads(body, bound)
    assert exc.value.problem.status == 413 and exc.value.problem.extensions["field"] == "body.ids"
    loads(b'{"ids": ["1:0:0"]}', bound)  # within the bound: read as before


@pytest.mark.parametrize("path", ["/v1/acks", "/v1/failures"])
def test_a_body_with_too_many_ids_is_a_413_whatever_its_values_hold(pg_dsn, schema, path):
    filler = ",".join(['"1:0:0"'] * 20)
    extra = ', "reason": "r"' if path == "/v1/failures" else ""
    with (
        RunningServer(http_config(pg_dsn, schema, max_ids_per_request=10), [TOKEN]) as s,
        httpx.Client(base_url=s.url, headers=AUTH, timeout=60) as c,
    ):
        for bad in ('"\\u0000"', "NaN", "[[1e999]]"):
            r = c.post(
                path, content=f'{{"ids": [{filler}, {bad}]{extra}}}', headers={"Content-Type": "application/json"}
            )
            assert r.status_code == 413, (bad, r.status_code, r.text)
            assert r.json()["field"] == "body.ids" and r.json()["limit"] == 10
