"""Bad input, generated (hypothesis): invalid configs, overrides and dataset records each end in
one clear error -- ConfigError whose lines name a dotted field, or DatasetError naming the file,
the record and the field -- never another exception from deep inside. Example counts are in
RELIABILITY.md. The examples are the same every run (CI stays reproducible);
``MEGATHUNDER_HYPOTHESIS_RANDOM=1`` draws fresh ones and ``MEGATHUNDER_HYPOTHESIS_EXAMPLES=N``
draws more, to hunt. A failure prints the input that caused it."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from megathunder.config import Config, ConfigError, load_config, parse_overrides
from megathunder.rollout.tasks.task import TaskInstance
from megathunder.rollout.tasks.datasets import (
    DatasetError,
    load_swe_bench,
    load_swe_smith,
)

NUM_EXAMPLES = int(os.environ.get("MEGATHUNDER_HYPOTHESIS_EXAMPLES", "200"))
SETTINGS = settings(
    max_examples=NUM_EXAMPLES, deadline=None,
    derandomize=os.environ.get("MEGATHUNDER_HYPOTHESIS_RANDOM") != "1", database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)  # fmt: skip


def _leaf_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _leaf_fields(ann, f"{prefix}{name}.")
        else:
            out.append(f"{prefix}{name}")
    return out


FIELDS = _leaf_fields(Config)
SECTIONS = sorted({f.rsplit(".", 1)[0] for f in FIELDS if "." in f})

# Values as a user might type them on a command line: YAML scalars, flow collections, junk.
scalar_text = st.one_of(
    st.integers(-(10**30), 10**30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from([".nan", ".inf", "-.inf", "null", "~", "true", "no", "[]", "{}", "[1, 2]",
                     "{a: 1}", "'quoted'", '"x', "[unclosed", "{a: [", "!!python/object:os.system",
                     "&a 1", "*a", "- x", ": :", "\t", "", "1e309", "0x1F", "1_000", "in_process",
                     "server", "bwrap", "drop_group", "thunder", "grpo", "http://0.0.0.0:1"]),
    st.text(max_size=20),
)  # fmt: skip
keys = st.one_of(
    st.sampled_from(FIELDS),
    st.sampled_from(SECTIONS),
    st.sampled_from(FIELDS).map(lambda f: f + ".sub"),
    st.sampled_from(FIELDS).map(lambda f: f.rsplit(".", 1)[0] + ".no_such_field"),
    st.text(alphabet="abc._=", min_size=0, max_size=12),
)


def _assert_clear(err: ConfigError) -> None:
    text = str(err)
    assert text and "Traceback" not in text
    if text.startswith("invalid configuration:"):
        for line in text.splitlines()[1:]:  # each names a dotted field (or a section's rule)
            assert line.startswith("  ") and line.strip(), text


@SETTINGS
@given(st.lists(st.tuples(keys, scalar_text), min_size=1, max_size=4))
def test_generated_overrides_validate_or_fail_clearly(pairs):
    overrides = [f"{k}={v}" for k, v in pairs]
    try:
        cfg = load_config(None, overrides)
    except ConfigError as err:
        _assert_clear(err)
    else:
        assert isinstance(cfg, Config)
        dumped = cfg.model_dump()
        assert _all_finite(dumped)  # no NaN / inf slipped through


@SETTINGS
@given(st.sampled_from(FIELDS), st.sampled_from(
    [[1, 2], {"x": 1}, "not-a-number-or-choice", math.nan, math.inf, -(10**40), 10**40, None,
     True, ""]))  # fmt: skip
def test_wrong_typed_field_names_that_field(field, value):
    """A value of the wrong type or range set on one field: either the field accepts it, or the
    error's first line names that field (or the section rule that blames it)."""
    tree: dict = {}
    node = tree
    parts = field.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    try:
        Config.model_validate(tree)
    except Exception:
        with pytest.raises(ConfigError) as err:
            _load_tree(tree)
        _assert_clear(err.value)
        if isinstance(value, (list, dict)):  # a type error: reported on the field itself
            assert f"\n  {field}" in str(err.value), str(err.value)
        else:  # or by a rule relating it to another field, which names one or the other
            text = str(err.value)
            assert field in text or f"\n  {field.rsplit('.', 1)[0]}" in text, text
    else:
        _load_tree(tree)


@SETTINGS
@given(st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8)),
    lambda kids: st.one_of(st.lists(kids, max_size=3),
                           st.dictionaries(st.one_of(st.sampled_from(SECTIONS + FIELDS), st.text(max_size=6)),
                                           kids, max_size=4)),
    max_leaves=12,
))  # fmt: skip
def test_generated_yaml_documents(doc):
    import yaml

    try:
        text = yaml.safe_dump(doc)
    except yaml.YAMLError:
        return
    try:
        _load_text(text)
    except ConfigError as err:
        _assert_clear(err)


@SETTINGS
@given(st.binary(max_size=200) | st.text(max_size=200))
def test_garbage_config_files(content):
    try:
        _load_text(content)
    except ConfigError as err:
        _assert_clear(err)


@SETTINGS
@given(st.lists(st.text(max_size=30), min_size=1, max_size=4))
def test_garbage_override_strings(items):
    try:
        parse_overrides(items)
        load_config(None, items)
    except ConfigError as err:
        _assert_clear(err)


@pytest.mark.parametrize(
    "text",
    ["a: [1, 2\n", "run: {seed: 1\n", "\tbad: tab\n", "!!python/object/apply:os.system ['true']\n",
     "run:\n  seed: 1\n run: 2\n", b"\xff\xfe\x00run", "---\na: 1\n---\nb: 2\n",
     "run: " + "[" * 5000 + "\n"],
)  # fmt: skip
def test_unparsable_config_files_are_config_errors(text):
    with pytest.raises(ConfigError, match="cfg.yaml"):
        _load_text(text)


def test_too_deeply_nested_override_is_a_config_error():
    with pytest.raises(ConfigError, match="run.seed: cannot parse value"):
        load_config(None, ["run.seed=" + "[" * 5000])


def _load_text(text: str | bytes):
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"megathunder-fuzz-{os.getpid()}" / "cfg.yaml"
    path.parent.mkdir(exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, errors="surrogatepass")
    return load_config(path)


def _load_tree(tree):
    import yaml

    return _load_text(yaml.safe_dump(tree))


def _all_finite(x) -> bool:
    if isinstance(x, float):
        return math.isfinite(x)
    if isinstance(x, dict):
        return all(_all_finite(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return all(_all_finite(v) for v in x)
    return True


# --- dataset records ------------------------------------------------------------------------------

LOADERS = {"swe_bench": load_swe_bench, "swe_smith": load_swe_smith}
RECORD_KEYS = ["instance_id", "problem_statement", "repo", "base_commit", "FAIL_TO_PASS",
               "PASS_TO_PASS", "test_patch", "test_command", "image_name", "image", "patch", "eval_script", "eval_test_files",
               "log_parser", "eval_type"]  # fmt: skip
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=10),
              st.just('["a::t"]'), st.just("[1]"), st.just("[bad")),
    lambda kids: st.one_of(st.lists(kids, max_size=3), st.dictionaries(st.text(max_size=5), kids, max_size=3)),
    max_leaves=6,
)  # fmt: skip
records = st.dictionaries(st.one_of(st.sampled_from(RECORD_KEYS), st.text(max_size=6)), json_values, max_size=10)
lines = st.one_of(
    records.map(json.dumps),
    json_values.map(json.dumps),  # valid JSON that is not an object
    st.text(max_size=30),  # not JSON at all
    st.just("[" * 5000 + "]" * 5000),  # deeper than the JSON parser's recursion
)


@SETTINGS
@given(st.sampled_from(sorted(LOADERS)), st.lists(lines, min_size=0, max_size=5), st.booleans())
def test_malformed_records_name_file_record_and_field(tmp_path_factory, loader, body, bad_bytes):
    path = tmp_path_factory.mktemp("ds") / "data.jsonl"
    data = "\n".join(body).encode(errors="surrogatepass")
    path.write_bytes(data + (b"\n\xff\xfe{" if bad_bytes else b""))
    try:
        out = LOADERS[loader](path)
    except DatasetError as err:
        msg = str(err)
        assert msg.startswith(str(path)), msg
        record_level = msg.startswith(f"{path}:") and not msg.startswith(f"{path}: ")
        if record_level:  # file:LINE: ... names the line, and the field when one is at fault
            line = int(msg[len(str(path)) + 1 :].split(":", 1)[0])
            assert 1 <= line <= data.count(b"\n") + 2
            if "field" in msg:
                assert any(f"'{k}'" in msg for k in RECORD_KEYS), msg
    else:
        assert out and all(isinstance(i, TaskInstance) and i.image for i in out)


@SETTINGS
@given(st.lists(records, min_size=1, max_size=4))
def test_malformed_parquet_rows(tmp_path_factory, rows):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path_factory.mktemp("pq") / "data.parquet"
    # parquet needs one type per column: store each value as its JSON text, or as-is when strings
    cols = sorted({k for r in rows for k in r})
    table = pa.table({c: [r.get(c) if isinstance(r.get(c), str) else json.dumps(r.get(c)) for r in rows]
                      for c in cols})  # fmt: skip
    pq.write_table(table, path)
    for loader in LOADERS.values():
        try:
            loader(path)
        except DatasetError as err:
            assert str(err).startswith(str(path))


@pytest.mark.parametrize("content", [b"", b"PAR1garbage", b"\x00" * 64])
def test_broken_parquet_files(tmp_path, content):
    path = tmp_path / "x.parquet"
    path.write_bytes(content)
    with pytest.raises(DatasetError, match="x.parquet"):
        load_swe_bench(path)
