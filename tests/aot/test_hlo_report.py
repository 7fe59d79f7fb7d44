"""What the report reads off a compiled program's optimized HLO, on HLO text written here: a
copy of the pool or of a weight counts where it writes device memory and reads a parameter;
prefetches into another memory space, fusion bodies and activations of a weight's shape do
not; conditionals and while loops are counted."""

from __future__ import annotations

from pagedjax.aot.compile import ProgramReport, largest_shapes
from pagedjax.aot.hlo_report import HloFindings, Memory, instructions, scan_hlo
from pagedjax.worker.input_batch import StepShape

POOL = [("bfloat16", (2, 64, 16, 128)), ("bfloat16", (2, 64, 16, 128))]
WEIGHTS = {("bfloat16", (128, 512)), ("bfloat16", (512, 128))}

HLO = """HloModule jit_step, entry_computation_layout={(bf16[128,512]{1,0})->bf16[4]{0}}

%fused_copy (param_0: bf16[2,64,16,128]) -> bf16[2,64,16,128] {
  %param_0 = bf16[2,64,16,128]{3,2,1,0} parameter(0)
  ROOT %copy.9 = bf16[2,64,16,128]{1,3,2,0} copy(%param_0)
}

%body (arg: (s32[], bf16[2,512,128])) -> (s32[], bf16[2,512,128]) {
  %arg = (s32[], bf16[2,512,128]{2,1,0}) parameter(0)
  %stack = bf16[2,512,128]{2,1,0} get-tuple-element(%arg), index=1
  %i = s32[] get-tuple-element(%arg), index=0
  %loop_dynamic_slice_fusion.3 = bf16[1,512,128]{2,1,0} fusion(%stack, %i), kind=kLoop, calls=%ds
  ROOT %t = (s32[], bf16[2,512,128]{2,1,0}) tuple(%i, %stack)
}

ENTRY %main.3 (w: bf16[128,512], pool: bf16[2,64,16,128], x: bf16[512,128]) -> bf16[4] {
  %w = bf16[128,512]{1,0} parameter(0)
  %pool = bf16[2,64,16,128]{3,2,1,0} parameter(1)
  %x = bf16[512,128]{1,0} parameter(2)
  %copy.1 = bf16[2,64,16,128]{1,3,2,0} copy(%pool)
  %view = bf16[2,1024,128]{2,1,0} bitcast(%pool)
  %copy.2 = bf16[2,1024,128]{1,0,2} copy(%view)
  %copy.3 = bf16[128,512]{1,0:T(8,128)(2,1)S(1)} copy(%w)
  %copy.4 = bf16[128,512]{0,1} copy(%w)
  %dot.5 = bf16[512,128]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %copy.6 = bf16[512,128]{0,1} copy(%dot.5)
  %fusion.7 = bf16[2,64,16,128]{3,2,1,0} fusion(%pool), kind=kLoop, calls=%fused_copy
  %copy-start.8 = (bf16[128,512]{1,0}, bf16[128,512]{1,0}, u32[]) copy-start(%w)
  %copy-done.8 = bf16[128,512]{1,0} copy-done(%copy-start.8)
  %cond = bf16[4]{0} conditional(%p, %x, %x), branch_computations={%a, %b}
  %loop = (s32[], bf16[2,512,128]) while(%init), condition=%c, body=%body
  ROOT %r = bf16[4]{0} slice(%cond), slice={[0:4]}
}
"""


def test_copies_of_the_pool_and_of_weights_are_found_where_they_write_device_memory():
    found = scan_hlo(HLO, POOL, WEIGHTS | {("bfloat16", (2, 512, 128))})
    # pool: copy.1 and copy.2 (a bitcast view: same bytes); the fusion's body is not a buffer
    assert found.pool_copies == 2
    # weights: copy.4 (a transpose of w), the asynchronous copy-done.8, the scan's slice of a
    # layer's row; not copy.3 (a prefetch into memory space 1) nor copy.6 (an activation)
    assert found.weight_copies == 3
    assert (found.conditionals, found.while_loops) == (1, 1)
    assert any("loop_dynamic_slice_fusion.3" in e for e in found.examples)


def test_fusion_bodies_are_not_read_as_buffers():
    names = {(i.computation, i.name) for i in instructions(HLO)}
    assert ("main.3", "copy.1") in names and ("fused_copy", "copy.9") not in names
    kinds = {i.name: i.kind for i in instructions(HLO)}
    assert kinds["loop_dynamic_slice_fusion.3"] == "slice" and kinds["copy-done.8"] == "copy"
    assert kinds["dot.5"] == "" and kinds["fusion.7"] == ""


def test_a_program_fails_on_memory_copies_or_conditionals():
    memory = Memory(arguments=10, outputs=6, donated=5, temporaries=3, code=1)
    assert memory.peak == 15
    clean = HloFindings(0, 0, 0, 2, ())
    assert ProgramReport("p", 1.0, memory=memory, findings=clean).failures(15) == []
    assert ProgramReport("p", 1.0, memory=memory, findings=clean).failures(14) == [
        "needs 0.00 GiB of 0.00"
    ]
    dirty = HloFindings(64, 1, 2, 0, ())
    assert ProgramReport("p", 1.0, memory=memory, findings=dirty).failures(99) == [
        "64 whole-pool copies",
        "1 weight copies",
        "2 conditionals",
    ]
    assert ProgramReport("p", 1.0, error="Mosaic failed").failures(99) == ["does not compile"]


def test_largest_shapes_are_the_widest_decode_and_prefill():
    shapes = [
        StepShape(8, 8, 16, 1),
        StepShape(256, 256, 128, 1),
        StepShape(256, 256, 16, 1),
        StepShape(2048, 8, 128, 512),
        StepShape(2048, 256, 128, 2048),
        StepShape(1024, 256, 128, 1024),
    ]
    assert largest_shapes(shapes) == [shapes[1], shapes[4]]
