"""communication_report on one device, its HLO reading on hand-written text, bad input.

The many-device behaviour is in tests/integration/test_communication.py.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp._communication import _describe
from jaxamp._hlo import hlo_dtype, parse_module
from jaxamp.testing import assert_gathers_in, assert_reduces_in

# Forms the partitioner does not emit on CPU but a backend's final program has:
# a variadic all-reduce, an async all-gather, an in-place collective-permute, a
# reduce-scatter, and a gather reached through a barrier and a call.
_HLO = """HloModule m, num_partitions=4

FileNames
1 "/home/user/model.py"
2 "/site-packages/jaxamp/_autocast/_matmul.py"

FunctionNames
1 "f"

FileLocations
1 {file_name_id=1 function_name_id=1 line=7 end_line=7 column=1 end_column=1}
2 {file_name_id=2 function_name_id=1 line=99 end_line=99 column=1 end_column=1}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%body (p0: bf16[2,8]) -> bf16[8,8] {
  %p0 = bf16[2,8]{1,0} parameter(0)
  ROOT %ag = bf16[8,8]{1,0} all-gather(%p0), dimensions={0}, metadata={op_name="jit(f)/dot_general" stack_frame_id=2}
}

ENTRY %main (w: f32[2,8], g: f32[8,8], h: bf16[4]) -> f32[] {
  %w = f32[2,8]{1,0} parameter(0), metadata={op_name="params[\\'w\\']"}
  %g = f32[8,8]{1,0} parameter(1), metadata={op_name="g"}
  %h = bf16[4]{0} parameter(2), metadata={op_name="h"}
  %c = bf16[2,8]{1,0} convert(%w)
  %t = (bf16[2,8]{1,0}, f32[8,8]{1,0}) tuple(%c, %g)
  %b = (bf16[2,8]{1,0}, f32[8,8]{1,0}) opt-barrier(%t)
  %e = bf16[2,8]{1,0} get-tuple-element(%b), index=0
  %call = bf16[8,8]{1,0} call(%e), to_apply=%body
  %ar = (f32[8,8]{1,0}, bf16[4]{0}) all-reduce(%g, %h), to_apply=%add, metadata={op_name="jit(f)/transpose(jvp(f))/dot_general" source_file="/x/y.py" source_line=3}
  %ags = (f32[2,8]{1,0}, f32[8,8]{1,0}) all-gather-start(%w), dimensions={0}
  %agd = f32[8,8]{1,0} all-gather-done(%ags)
  %rs = f32[2,8]{1,0} reduce-scatter(%g), dimensions={0}, to_apply=%add
  %cp = f32[8,8]{1,0} collective-permute(%g), source_target_pairs={{0,1}}
  ROOT %r = f32[] constant(0)
}
"""  # noqa: E501 (HLO lines are as long as XLA prints them)


def _collectives(text: str = _HLO) -> list:
    module = parse_module(text)
    return [c for inst in module.collectives() for c in _describe(inst, module)]


def test_reads_each_collective_form_with_its_bytes_and_source():
    got = [(c.kind, c.dtype.name, c.shape, c.bytes, c.parameter) for c in _collectives()]
    assert got == [
        ("all-gather", "bfloat16", (8, 8), 128, "params['w']"),  # through barrier and call
        ("all-reduce", "float32", (8, 8), 256, "g"),
        ("all-reduce", "bfloat16", (4,), 8, "h"),
        ("all-gather", "float32", (8, 8), 256, "params['w']"),  # the -start's output half
        ("reduce-scatter", "float32", (8, 8), 256, "g"),  # the full input
        ("collective-permute", "float32", (8, 8), 256, "g"),
    ]
    gather, reduce = _collectives()[:2]
    # The innermost frame outside jaxamp; else the metadata's own source line.
    assert gather.location == "/home/user/model.py:7"
    assert reduce.location == "/x/y.py:3" and reduce.backward and not gather.backward
    assert parse_module(_HLO).num_partitions == 4


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("bf16", jnp.bfloat16),
        ("f8e4m3fn", jnp.float8_e4m3fn),
        ("f8e5m2", jnp.float8_e5m2),
        ("s32", np.int32),
        ("u8", np.uint8),
        ("pred", np.bool_),
    ],
)
def test_hlo_dtypes(name, dtype):
    assert hlo_dtype(name) == np.dtype(dtype)


def test_one_device_program_has_no_collectives_and_counts_floating_params():
    params = {"w": jnp.ones((4, 2)), "step": jnp.zeros((), jnp.int32)}
    report = jaxamp.communication_report(lambda p, x: x @ p["w"], params, jnp.ones((3, 4)))
    assert report.collectives == () and report.num_devices == 1
    assert report.param_count == 8  # the int32 leaf is not a parameter
    assert report.bytes_by() == 0 and np.isnan(
        dataclasses.replace(report, param_count=0).bytes_per_param()
    )
    assert "communication on 1 devices, 8 parameters" in str(report)


def test_totals_and_per_param():
    report = jaxamp.CommunicationReport(tuple(_collectives()), 64, 4, _HLO)
    assert report.bytes_by("all-reduce") == 264
    assert report.bytes_by("all-reduce", "bfloat16") == report.bytes_by(dtype=jnp.bfloat16) - 128
    assert report.count_by("all-gather") == 2
    assert report.bytes_per_param("all-gather", jnp.float32) == 4.0
    totals = report.totals()
    assert next(iter(totals)) == ("all-gather", np.dtype(jnp.bfloat16))
    assert totals[("all-reduce", np.dtype(np.float32))] == (1, 256)
    assert "params['w']" in str(report) and "B/param" in str(report)
    # Without a parameter, the source is the op and its line.
    assert (
        dataclasses.replace(report.collectives[1], parameter=None).source == "dot_general (y.py:3)"
    )


def test_bad_input_names_the_argument():
    report = jaxamp.CommunicationReport(tuple(_collectives()), 64, 4, _HLO)
    with pytest.raises(TypeError, match="fun must be callable; got int"):
        jaxamp.communication_report(3, jnp.ones(2))
    with pytest.raises(ValueError, match="kind must be None or one of .*'allgather'"):
        report.bytes_by("allgather")
    with pytest.raises(TypeError, match="dtype must be a dtype .*got 'bf17'"):
        report.bytes_by(dtype="bf17")
    with pytest.raises(TypeError, match="target must be a CommunicationReport or a callable"):
        assert_gathers_in("report", jnp.bfloat16)
    with pytest.raises(TypeError, match="args and kwargs must be empty"):
        assert_reduces_in(report, jnp.float32, (1,))


def test_assertions_list_the_offenders_and_fail_on_nothing():
    report = jaxamp.CommunicationReport(tuple(_collectives()), 64, 4, _HLO)
    with pytest.raises(
        AssertionError, match=r"1 of 2 \(all-gather of a parameter\) not in bfloat16"
    ):
        assert_gathers_in(report, jnp.bfloat16)
    # The backward all-reduce has a float32 and a bfloat16 operand.
    with pytest.raises(AssertionError, match=r"all-reduce bfloat16\[4\] from h"):
        assert_reduces_in(report, jnp.float32)
    empty = jaxamp.CommunicationReport((), 0, 8, "")
    with pytest.raises(AssertionError, match="no gradient reduction"):
        assert_reduces_in(empty, jnp.float32)
