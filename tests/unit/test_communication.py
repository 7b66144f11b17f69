"""communication_report on one device, its HLO reading on hand-written text, bad input.

The many-device behaviour is in tests/integration/test_communication.py.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp._wire._collectives import _describe, report_from_hlo
from jaxamp._wire._hlo import hlo_dtype, parse_module
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
    # The argument's own dtype, beside the wire's.
    assert [(c.parameter, c.parameter_dtype) for c in _collectives()[:3]] == [
        ("params['w']", np.float32),
        ("g", np.float32),
        ("h", jnp.bfloat16),
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
        ("f4e2m1fn", jnp.float4_e2m1fn),
        ("f8e8m0fnu", jnp.float8_e8m0fnu),
        ("s4", jnp.int4),
        ("u4", jnp.uint4),
    ],
)
def test_hlo_dtypes(name, dtype):
    assert hlo_dtype(name) == np.dtype(dtype)


def test_a_float4_gather_is_named_and_half_a_byte_per_element():
    text = """HloModule m, num_partitions=8

ENTRY %main (w: f4e2m1fn[2,16], x: s4[3]) -> f32[] {
  %w = f4e2m1fn[2,16]{1,0} parameter(0), metadata={op_name="params[\\'w\\']"}
  %x = s4[3]{0} parameter(1), metadata={op_name="x"}
  %ag = f4e2m1fn[16,16]{1,0} all-gather(%w), dimensions={0}
  %agx = s4[24]{0} all-gather(%x), dimensions={0}
  ROOT %r = f32[] constant(0)
}
"""
    got = [(c.dtype.name, c.shape, c.bytes, c.parameter) for c in _collectives(text)]
    # 4 bits an element: 256 elements are 128 bytes, 24 are 12 (odd counts round up).
    assert got == [
        ("float4_e2m1fn", (16, 16), 128, "params['w']"),
        ("int4", (24,), 12, "x"),
    ]
    report = report_from_hlo(text, param_count=32)
    assert report.bytes_per_param("all-gather", jnp.float4_e2m1fn) == 128 / 32


def test_a_gather_in_stages_counts_the_whole_tensor_once():
    # The partitioner gathers a dim split over two array dims in two stages;
    # the second gathers (through a copy) what the first gathered.
    text = """HloModule m, num_partitions=8

ENTRY %main (w: f8e4m3fn[1,2,16,1,16]) -> f32[] {
  %w = f8e4m3fn[1,2,16,1,16]{4,3,2,1,0} parameter(0), metadata={op_name="params[\\'w\\']"}
  %one = f8e4m3fn[1,2,16,1,64]{4,3,2,1,0} all-gather(%w), dimensions={4}
  %copy = f8e4m3fn[1,2,16,1,64]{4,3,2,1,0} copy(%one)
  %two = f8e4m3fn[1,2,16,2,64]{4,3,2,1,0} all-gather(%copy), dimensions={3}
  %other = f8e4m3fn[1,2,16,1,64]{4,3,2,1,0} all-gather(%w), dimensions={4}
  ROOT %r = f32[] constant(0)
}
"""
    got = [(c.shape, c.bytes, c.staged, c.parameter) for c in _collectives(text)]
    assert got == [
        ((1, 2, 16, 1, 64), 2048, False, "params['w']"),
        ((1, 2, 16, 2, 64), 4096 - 2048, True, None),
        ((1, 2, 16, 1, 64), 2048, False, "params['w']"),
    ]
    report = report_from_hlo(text, param_count=2 * 16 * 128)
    # Two stages: one byte per element of the whole tensor; and the other gather.
    assert report.bytes_per_param("all-gather") == (4096 + 2048) / (2 * 16 * 128)


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
        AssertionError, match=r"1 of 2 \(floating parameter all-gather\) not in bfloat16"
    ):
        assert_gathers_in(report, jnp.bfloat16)
    # The backward all-reduce has a float32 and a bfloat16 operand.
    with pytest.raises(AssertionError, match=r"all-reduce bfloat16\[4\] from h"):
        assert_reduces_in(report, jnp.float32)
    empty = jaxamp.CommunicationReport((), 0, 8, "")
    with pytest.raises(AssertionError, match="no gradient reduction"):
        assert_reduces_in(empty, jnp.float32)


# XLA's newer text (jax 0.12): a read of one tuple element is ``%name#i`` in the
# reader's operands, with no get-tuple-element of its own. The weight reaches
# its gather through a cast and autocast's operand barrier, a bias through a
# broadcast that adds a unit dimension, a norm's scale through ``1 + scale``
# and a one-value barrier.
_SHORT_FORM = """HloModule m, num_partitions=4

ENTRY %main (w: f32[2,8], b: f32[8], s: f32[8]) -> f32[] {
  %w = f32[2,8]{1,0} parameter(0), metadata={op_name="p[\\'w\\']"}
  %b = f32[8]{0} parameter(1), metadata={op_name="p[\\'b\\']"}
  %s = f32[8]{0} parameter(2), metadata={op_name="p[\\'s\\']"}
  %x = bf16[2,8]{1,0} constant({...})
  %c = bf16[2,8]{1,0} convert(%w)
  %t = (bf16[2,8]{1,0}, bf16[2,8]{1,0}) tuple(%x, %c)
  %ob = (bf16[2,8]{1,0}, bf16[2,8]{1,0}) opt-barrier(%t)
  %ag = bf16[8,8]{1,0} all-gather(%ob#1), dimensions={0}, metadata={op_name="jit(f)/optimization_barrier"}
  %ar = bf16[2,8]{1,0} all-reduce(%ob#0), to_apply=%add
  %r = f32[1,8]{1,0} reshape(%b)
  %zero = f32[] constant(0)
  %lo = f32[1,8]{1,0} broadcast(%zero), dimensions={}
  %m = f32[1,8]{1,0} maximum(%r, %lo)
  %bc = bf16[1,8]{1,0} convert(%m)
  %bb = bf16[1,8]{1,0} broadcast(%bc), dimensions={0,1}
  %v = bf16[8]{0} reshape(%bb)
  %agb = bf16[32]{0} all-gather(%v), dimensions={0}
  %one = f32[] constant(1)
  %ones = f32[8]{0} broadcast(%one), dimensions={}
  %shift = f32[8]{0} add(%s, %ones)
  %os = f32[8]{0} opt-barrier(%shift)
  %ags = f32[32]{0} all-gather(%os), dimensions={0}
  %agz = f32[32]{0} all-gather(%lo), dimensions={0}
  ROOT %out = f32[] constant(0)
}
"""  # noqa: E501 (HLO lines are as long as XLA prints them)


def test_follows_the_short_tuple_element_form_barriers_and_unit_broadcasts():
    got = [(c.kind, c.dtype.name, c.shape, c.bytes, c.parameter) for c in _collectives(_SHORT_FORM)]
    assert got == [
        ("all-gather", "bfloat16", (8, 8), 128, "p['w']"),
        # The tuple element's own type: one bf16[2,8], not the whole tuple.
        ("all-reduce", "bfloat16", (2, 8), 32, None),
        ("all-gather", "bfloat16", (32,), 64, "p['b']"),  # the clamp bound is not the data
        ("all-gather", "float32", (32,), 128, "p['s']"),
        ("all-gather", "float32", (32,), 128, None),  # a broadcast scalar: not a parameter
    ]


def _gather(shape, itemsize=4, parameter="p", dtype=np.float32):
    return jaxamp.Collective(
        "all-gather", np.dtype(dtype), shape, int(np.prod(shape)) * itemsize, parameter, "", None
    )


def test_small_gathers_are_vectors_16x_below_the_largest_gather():
    matrix = _gather((32, 32), 2, "w", jnp.bfloat16)  # 2048 bytes
    scale = _gather((32,), 4, "scale")  # 128 bytes: 16x smaller, small
    bias = _gather((1, 64, 1), 4, "b")  # 256 bytes: a vector, but only 8x smaller
    rows = _gather((2, 16), 4, "r")  # 128 bytes, but not a vector
    ids = _gather((32,), 4, "ids", np.int32)
    reduce = dataclasses.replace(scale, kind="all-reduce")  # not a gather
    report = jaxamp.CommunicationReport((matrix, scale, bias, rows, ids, reduce), 1024, 4, "")
    assert report.small_gathers == (scale, ids)
    lines = str(report).splitlines()
    listing = lines[next(i for i, line in enumerate(lines) if " shape " in line) + 1 :]
    assert [line.split()[-1] == "small" for line in listing if line.startswith("all-")] == [
        False, True, False, False, True, False
    ]  # fmt: skip
    assert lines[-1] == (
        "small: 2 all-gathers of vectors, each at least 16x smaller than the largest "
        "(256 bytes, 0.25 B/param together): not worth a dtype decision"
    )
    # A program whose gathers are all vectors (a flat parameter buffer): the
    # largest is not small.
    flat = jaxamp.CommunicationReport((_gather((4096,)), _gather((128,))), 0, 4, "")
    assert flat.small_gathers == (flat.collectives[1],)
    assert "small:" not in str(dataclasses.replace(report, collectives=(matrix, bias)))


def test_assert_gathers_in_judges_floating_parameters_and_lists_the_rest():
    matrix = _gather((32, 32), 2, "w", jnp.bfloat16)
    scale = _gather((32,), 4, "scale")
    ids = _gather((8,), 4, "ids", np.int32)
    report = jaxamp.CommunicationReport((ids, matrix, scale), 1024, 4, "")
    assert assert_gathers_in(report, jnp.bfloat16) is report
    not_judged = (
        "\nnot judged (2):\n  all-gather int32[8] from ids (not floating)"
        "\n  all-gather float32[32] from scale (small)"
    )
    with pytest.raises(AssertionError) as failed:
        assert_gathers_in(report, jnp.float32)
    assert str(failed.value) == (
        "1 of 1 (floating parameter all-gather) not in float32:\n"
        "  all-gather bfloat16[32,32] from w" + not_judged
    )
    # A float32 weight quantized to int8 for the wire is a parameter: judged.
    int8 = dataclasses.replace(
        matrix, dtype=np.dtype(np.int8), bytes=1024, parameter_dtype=np.dtype(np.float32)
    )
    with pytest.raises(AssertionError, match=r"1 of 2 .*\n  all-gather int8\[32,32\] from w\n"):
        assert_gathers_in(
            dataclasses.replace(report, collectives=(*report.collectives, int8)), jnp.bfloat16
        )
    # Only integer and small parameter gathers (next to an activation's):
    # nothing judged, which fails and says why.
    activation = dataclasses.replace(matrix, parameter=None)
    with pytest.raises(AssertionError) as failed:
        assert_gathers_in(
            dataclasses.replace(report, collectives=(ids, activation, scale)), jnp.bfloat16
        )
    assert str(failed.value) == (
        "no floating parameter all-gather in the program (4 devices); nothing to check."
        + not_judged
    )
