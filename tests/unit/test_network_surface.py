"""The package's network surface, checked statically: no code path deserialises pickles (or
other code-carrying formats), nothing binds a wildcard address by default, and the weight payload
that crosses the network is JSON carrying safetensors."""

from __future__ import annotations

import ast
import base64
import json
from pathlib import Path

import torch

from megathunder.rollout.engines.rpc import weight_load_call

PACKAGE = Path(__file__).resolve().parents[2] / "megathunder"
BANNED_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve", "joblib"}


def _violations(tree: ast.AST, where: str) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                if name.split(".")[0] in BANNED_MODULES:
                    found.append(f"{where}:{node.lineno}: imports {name}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            kwargs = {k.arg: ast.unparse(k.value) for k in node.keywords}
            call = f"{owner}.{node.func.attr}"
            if call == "torch.load" and kwargs.get("weights_only") != "True":
                found.append(f"{where}:{node.lineno}: torch.load without weights_only=True")
            if call in ("yaml.load", "yaml.unsafe_load", "yaml.full_load"):
                found.append(f"{where}:{node.lineno}: {call} (use yaml.safe_load)")
            if call in ("np.load", "numpy.load") and kwargs.get("allow_pickle") == "True":
                found.append(f"{where}:{node.lineno}: {call}(allow_pickle=True)")
            if node.func.attr in ("loads", "load") and owner in BANNED_MODULES:
                found.append(f"{where}:{node.lineno}: {call}")
    return found


def test_scanner_catches_each_pattern():
    bad = (
        "import pickle\nfrom cloudpickle import loads\nimport torch, yaml, numpy as np\n"
        "torch.load(f)\ntorch.load(f, weights_only=False)\nyaml.load(s)\nnp.load(f, allow_pickle=True)\n"
        "pickle.loads(b)\n"
    )
    assert len(_violations(ast.parse(bad), "x")) == 7
    good = "import json, yaml, torch\ntorch.load(f, weights_only=True)\nyaml.safe_load(s)\njson.loads(s)\n"
    assert _violations(ast.parse(good), "x") == []


def test_package_deserialises_no_pickles():
    found = []
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50
    for path in files:
        found += _violations(ast.parse(path.read_text(), str(path)), str(path.relative_to(PACKAGE.parent)))
    assert found == []


def test_weight_payload_is_json_with_safetensors():
    call = weight_load_call(iter([("layer.weight", torch.randn(4, 4))]))
    wire = json.dumps(call.as_json())  # what goes over HTTP to /collective_rpc
    payload = base64.b64decode(json.loads(wire)["args"][0])
    header_len = int.from_bytes(payload[:8], "little")
    assert json.loads(payload[8 : 8 + header_len])["layer.weight"]["dtype"] == "F32"
    assert not payload.startswith(b"\x80")  # no pickle protocol marker


WILDCARDS = {"0.0.0.0", "::", "[::]", "*"}


def _wildcard_binds(tree: ast.AST, where: str) -> list[str]:
    """String constants naming a wildcard address, where a host is given: a default argument or
    field value, a keyword ``host=``, or an address tuple passed to ``bind``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg in ("host", "bind", "address"):
            if isinstance(node.value, ast.Constant) and node.value.value in WILDCARDS:
                found.append(f"{where}:{node.value.lineno}: {node.arg}={node.value.value!r}")
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            names = [ast.unparse(t) for t in targets]
            if any("host" in n or "addr" in n for n in names) and isinstance(node.value, ast.Constant):
                if node.value.value in WILDCARDS:
                    found.append(f"{where}:{node.lineno}: {names[0]} = {node.value.value!r}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "bind":
            for arg in node.args:
                if isinstance(arg, ast.Tuple) and arg.elts and isinstance(arg.elts[0], ast.Constant):
                    if arg.elts[0].value in WILDCARDS or arg.elts[0].value == "":
                        found.append(f"{where}:{node.lineno}: bind({ast.unparse(arg)})")
    return found


def test_scanner_catches_wildcard_binds():
    bad = 'host: str = "0.0.0.0"\nrun(host="::")\ns.bind(("", 80))\nlisten_addr = "0.0.0.0"\n'
    assert len(_wildcard_binds(ast.parse(bad), "x")) == 4
    good = 'host: str = "127.0.0.1"\ns.bind(("127.0.0.1", 0))\n'
    assert _wildcard_binds(ast.parse(good), "x") == []


def test_nothing_binds_a_wildcard_address_by_default():
    from megathunder.config import EngineConfig

    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += _wildcard_binds(ast.parse(path.read_text()), str(path.relative_to(PACKAGE.parent)))
    assert found == []
    assert EngineConfig().host == "127.0.0.1"
