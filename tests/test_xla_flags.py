"""The tests' XLA:CPU rendezvous timeouts (``tests/conftest.py``) are in effect.

XLA:CPU ends the process when a device thread reaches a collective more than a timeout after
the others ("Expected 2 threads to join the rendezvous, but only 1 of them arrived"): on a
loaded machine a thread can be that late. conftest raises the timeouts with XLA flags, in the
same ``XLA_FLAGS`` string as the device count, before JAX starts; the docs-snippet runner
appends them to the ``XLA_FLAGS`` each page sets. A subprocess shows the flags are the knobs:
with short timeouts a late device ends the process, with the tests' ones it does not.
"""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from tests import test_docs_snippets as snippets
from tests.conftest import (
    RENDEZVOUS_TIMEOUT_S,
    XLA_COMPILE_FLAGS,
    XLA_FUSION_FLAGS,
    XLA_TEST_FLAGS,
    XLA_TIMEOUT_FLAGS,
    xla_fusion_flags,
    xla_timeout_flags,
)

ROOT = Path(__file__).resolve().parent.parent
NAMES = (
    "xla_cpu_collective_call_warn_stuck_timeout_seconds",
    "xla_cpu_collective_call_terminate_timeout_seconds",
    "xla_cpu_collective_timeout_seconds",
)


def _flags(text: str) -> dict[str, str]:
    """``{name: value}`` of the ``--name=value`` flags in an XLA_FLAGS string (last wins)."""
    return dict(re.findall(r"--(\w+)=(\S+)", text))


def test_timeouts_are_in_the_xla_flags_the_test_process_started_with():
    """Every supported jaxlib (0.9.0 on) gets the three timeouts, all generous, in the one
    XLA_FLAGS string whose device count XLA has read (8 devices): XLA parses the string once,
    and aborts on a flag it does not know, so it has read the timeouts too."""
    assert jax.device_count() == 8
    flags = _flags(os.environ["XLA_FLAGS"])
    assert flags.get("xla_force_host_platform_device_count") == "8"
    assert xla_timeout_flags() == XLA_TIMEOUT_FLAGS
    assert {f"--{n}={RENDEZVOUS_TIMEOUT_S}" for n in NAMES} == set(XLA_TIMEOUT_FLAGS)
    for name in NAMES:
        assert int(flags[name]) >= 600, (name, flags.get(name))


def test_no_timeout_flags_for_a_jaxlib_that_may_not_know_them():
    assert xla_timeout_flags("0.8.2") == ()
    assert len(xla_timeout_flags("0.9.0")) == len(xla_timeout_flags("0.12.0.1")) == 3


def test_the_docs_runner_appends_the_timeouts_to_a_page_s_xla_flags():
    env = snippets._page_env()
    assert "XLA_FLAGS" not in env
    assert env[snippets.EXTRA_FLAGS_ENV].split() == list(XLA_TEST_FLAGS)
    code = 'import os\nos.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"\n'
    tree = snippets._ExtraXlaFlags(env[snippets.EXTRA_FLAGS_ENV]).visit(ast.parse(code))
    namespace: dict = {}
    saved = os.environ["XLA_FLAGS"]
    try:
        exec(compile(tree, "<page>", "exec"), namespace)
        got = _flags(os.environ["XLA_FLAGS"])
    finally:
        os.environ["XLA_FLAGS"] = saved
    assert got["xla_force_host_platform_device_count"] == "8"
    for name in NAMES:
        assert got[name] == str(RENDEZVOUS_TIMEOUT_S)
    for flag in (*XLA_COMPILE_FLAGS, *XLA_FUSION_FLAGS):
        name, value = flag.removeprefix("--").split("=")
        assert got[name] == value


# Device 0 reaches the psum 3 s after device 1 (a host callback sleeps on it).
LATE_DEVICE = """
import time
import jax, jax.numpy as jnp
from jax import lax
from jax.experimental import io_callback
from jax.sharding import NamedSharding, PartitionSpec as P

mesh = jax.make_mesh((2,), ("x",))
x = jax.device_put(jnp.ones((2,)), NamedSharding(mesh, P("x")))

def late(x):
    return io_callback(lambda y: (time.sleep(3), y)[1], jax.ShapeDtypeStruct(x.shape, x.dtype), x)

def body(x):
    return lax.psum(lax.cond(lax.axis_index("x") == 0, late, lambda x: x, x), "x")

f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
print("sum", f(x).tolist())
"""


def _run_jax(code: str, devices: int, flags: list[str]) -> subprocess.CompletedProcess:
    """``code`` in a fresh process on ``devices`` CPU devices with exactly ``flags``, compiling
    every program itself (the run's compilation cache is not passed on)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join([f"--xla_force_host_platform_device_count={devices}", *flags])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _run_late_device(flags: list[str]) -> subprocess.CompletedProcess:
    return _run_jax(LATE_DEVICE, 2, flags)


@pytest.mark.slow
@pytest.mark.skipif(not XLA_TIMEOUT_FLAGS, reason="this jaxlib gets no timeout flags")
def test_the_flags_decide_whether_a_late_device_ends_the_process():
    short = [f"--{n}=1" for n in NAMES]
    proc = _run_late_device(short)
    assert proc.returncode != 0, proc.stdout
    assert "Expected 2 threads to join the rendezvous, but only 1 of them arrived" in proc.stderr
    proc = _run_late_device(list(XLA_TIMEOUT_FLAGS))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sum [2.0, 2.0]" in proc.stdout


def test_the_quick_compile_flags_and_the_run_s_cache_are_in_effect():
    flags = _flags(os.environ["XLA_FLAGS"])
    for flag in (*XLA_COMPILE_FLAGS, *XLA_FUSION_FLAGS):
        name, value = flag.removeprefix("--").split("=")
        assert flags.get(name) == value, (name, flags.get(name))
    cache = os.environ["SHARDLIB_TEST_JAX_CACHE"]
    assert jax.config.jax_compilation_cache_dir == cache
    assert Path(cache).is_dir()


# The headline model's train step, compiled and run once (`compiled`, `new_model`, `loss`).
_STEP = """
import hashlib, json, re
import jax, jax.numpy as jnp
from examples import transformer_model as tm
from tests import multiprocess_worker as worker

mesh = jax.make_mesh((4, 2), ("d", "t"))
with jax.set_mesh(mesh):
    model = tm.place_model(tm.init_model(worker.CONFIG, jax.random.key(0)))
    tokens = jax.device_put(worker.global_tokens(), jax.sharding.NamedSharding(mesh, jax.P("d", None)))
    step = jax.jit(tm.train_step, static_argnums=0)
    compiled = step.lower(worker.CONFIG, model, tokens, worker.LR).compile()
    new_model, loss = step(worker.CONFIG, model, tokens, worker.LR)
"""
# A digest of its HLO, XLA's temp bytes, and the loss.
COMPILED_STEP = (
    _STEP
    + """
print(hashlib.sha256(compiled.as_text().encode()).hexdigest(),
      compiled.memory_analysis().temp_size_in_bytes, float(loss).hex())
"""
)


@pytest.mark.slow
def test_the_quick_compile_flags_change_no_hlo_and_no_loss():
    """What the tests read of a compiled program (its HLO text, XLA's memory analysis, the
    values) is the same with XLA_COMPILE_FLAGS as without: they only make LLVM quicker."""
    outs = []
    for flags in ([], list(XLA_COMPILE_FLAGS)):
        proc = _run_jax(COMPILED_STEP, 8, flags)  # compiles both, loads neither
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append(proc.stdout.split())
    assert len(outs[0]) == 3 and outs[0] == outs[1], outs


def test_the_old_emitters_only_for_the_jaxlibs_that_have_them():
    """jaxlib 0.9 and 0.10 know the flag (their runs here take it); 0.11 dropped it, and an
    unknown flag makes XLA abort."""
    flag = ("--xla_cpu_use_fusion_emitters=false",)
    assert xla_fusion_flags("0.9.0") == xla_fusion_flags("0.10.2") == flag
    assert xla_fusion_flags("0.11.0") == xla_fusion_flags("0.12.0.1") == ()


# Each collective of its compiled HLO (kind, result type, replica groups), XLA's temp bytes,
# the loss and each updated parameter's sum.
COLLECTIVES_STEP = (
    _STEP
    + """
text = compiled.as_text()
kinds = r"all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute"
ops = sorted(
    f"{m.group(1)} {m.group(2)} {re.search(r'(replica_groups|source_target_pairs)=[^ ]*', line).group(0)}"
    for line in text.splitlines()
    if (m := re.search(rf"= (\\S+) ({kinds})(?:-start)?\\(", line))
)
leaves = [float(jnp.sum(x)).hex() for x in jax.tree.leaves(new_model)]
print(json.dumps({"hlo": hashlib.sha256(text.encode()).hexdigest(), "collectives": ops,
                  "temp": compiled.memory_analysis().temp_size_in_bytes,
                  "loss": float(loss).hex(), "params": leaves}))
"""
)


@pytest.mark.slow
@pytest.mark.skipif(not XLA_FUSION_FLAGS, reason="this jaxlib has no old emitters")
def test_the_old_emitters_change_no_collective_and_no_value():
    """XLA_FUSION_FLAGS change how XLA:CPU fuses elementwise ops (the HLO text differs, which
    shows the flag is live), not what the tests read: the collectives (kind, type, groups) and
    the loss are the same, every updated parameter to float32 rounding (a fused sum may round
    its last bit otherwise), XLA's temp bytes within 5%."""
    outs = []
    for flags in (list(XLA_COMPILE_FLAGS), [*XLA_COMPILE_FLAGS, *XLA_FUSION_FLAGS]):
        proc = _run_jax(COLLECTIVES_STEP, 8, flags)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    default, old = outs
    assert default["hlo"] != old["hlo"]
    assert default["collectives"] and default["collectives"] == old["collectives"]
    assert default["loss"] == old["loss"]
    for a, b in zip(default["params"], old["params"], strict=True):  # fused sums round alike
        assert abs(float.fromhex(a) - float.fromhex(b)) <= 1e-6 * abs(float.fromhex(a)), (a, b)
    assert abs(old["temp"] - default["temp"]) <= 0.05 * default["temp"], (default, old)
