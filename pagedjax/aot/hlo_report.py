"""What a compiled program says about itself: its memory (``memory_analysis``), its cost where
the compiler gives one (``cost_analysis``: XLA:TPU does), and what its optimized HLO holds that
a step must not: copies of the whole KV pool, copies or slices of a weight, conditionals.

The HLO is the target compiler's own text (``compiled.as_text()``), read line by line:
``%name = dtype[dims]{layout} opcode(operands), ..., calls=%computation``. A copy is a ``copy``
(or an asynchronous copy's ``copy-done``), or a fusion XLA named for one; a slice is a
``dynamic-slice`` or a fusion named for one. A pool copy has the dtype and element count of one
of the pool's arrays (a per-device shard on a mesh); a weight copy the dtype and shape of a
weight (one layer's row of a stacked one) and reads a parameter. Only copies written to device
memory count: on a TPU, XLA also prefetches operands into VMEM (memory space 1), which moves
what the program reads anyway.
"""

from __future__ import annotations

import dataclasses
import math
import re

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+) \(.*\{\s*$")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+) = (?P<type>.+?) (?P<op>[\w\-]+)\((?P<rest>.*)$"
)
_SPACE = re.compile(r"S\((\d+)\)\}$")  # a layout's memory space, e.g. {1,0:T(8,128)S(1)}
_ARRAY = re.compile(r"(?P<dtype>\w+)\[(?P<dims>[\d,]*)\]")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_OPERAND = re.compile(r"%([\w.\-]+)")
_COPIES = ("copy", "copy-done")  # an asynchronous copy's buffer is its copy-done's
_SLICES = ("dynamic-slice",)
# Ops through which an operand is still the buffer it names.
_SAME_BUFFER = ("bitcast", "get-tuple-element", "copy", "copy-start", "copy-done")
# HLO element types -> numpy dtype names (the ones a pool or a weight can have)
_DTYPES = {
    "f32": "float32",
    "bf16": "bfloat16",
    "f16": "float16",
    "s8": "int8",
    "f8e4m3fn": "float8_e4m3fn",
    "s32": "int32",
    "u8": "uint8",
}


@dataclasses.dataclass(frozen=True)
class Instruction:
    computation: str
    name: str
    dtype: str  # numpy's name where known, else HLO's ("" for a tuple)
    shape: tuple[int, ...]
    opcode: str
    calls: str  # the called computation's name (fusions), else ""
    operands: tuple[str, ...]
    memory_space: int = 0  # 0: the device's memory; on a TPU, 1: VMEM (the layout's S(1))

    @property
    def kind(self) -> str:
        """ "copy", "slice" or "": a fusion counts as what XLA named it for (``copy_fusion``,
        ``loop_dynamic_slice_fusion``...)."""
        name = self.name.split(".")[0].replace("-", "_") if self.opcode == "fusion" else ""
        if self.opcode in _COPIES or "copy" in name:
            return "copy"
        if self.opcode in _SLICES or "dynamic_slice" in name:
            return "slice"
        return ""


def instructions(hlo_text: str) -> list[Instruction]:
    """Every instruction of the module's computations but fusion bodies (whose instructions
    write no buffer of their own)."""
    out, computation, fused = [], "", set()
    for line in hlo_text.splitlines():
        head = _COMPUTATION.match(line)
        if head is not None:
            computation = head["name"]
            continue
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        calls = _CALLS.search(m["rest"])
        calls = calls[1] if calls else ""
        if m["op"] == "fusion":
            fused.add(calls)
        array = _ARRAY.fullmatch(m["type"].split("{")[0])
        dtype = _DTYPES.get(array["dtype"], array["dtype"]) if array else ""
        shape = tuple(int(d) for d in array["dims"].split(",") if d) if array else ()
        operands = tuple(_OPERAND.findall(_operand_list(m["rest"])))
        space = _SPACE.search(m["type"]) if array else None
        ins = Instruction(computation, m["name"], dtype, shape, m["op"], calls, operands)
        out.append(dataclasses.replace(ins, memory_space=int(space[1]) if space else 0))
    return [i for i in out if i.computation not in fused]


def _operand_list(rest: str) -> str:
    """The text of an instruction's operands: ``rest`` up to its closing parenthesis."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            return rest[:i]
    return rest


@dataclasses.dataclass(frozen=True)
class HloFindings:
    pool_copies: int  # copies of as many elements as a pool array, of its dtype
    weight_copies: int  # copies or slices of a weight's shape
    conditionals: int
    while_loops: int
    examples: tuple[str, ...]  # the first few offending instructions, named


def scan_hlo(hlo_text: str, pool_arrays, weight_shapes) -> HloFindings:
    """``pool_arrays``: (dtype, per-device shape) of each pool array; ``weight_shapes``: the
    (dtype, shape) set a weight (or one layer's row of it) has on a device."""
    pool_sizes = {(dtype, math.prod(shape)) for dtype, shape in pool_arrays}
    weight_shapes = {(dtype, _squeezed(shape)) for dtype, shape in weight_shapes}
    found = instructions(hlo_text)
    by_name = {(i.computation, i.name): i for i in found}
    pool = weights = conds = loops = 0
    examples = []
    for ins in found:
        # A copy into another memory space (a TPU's VMEM) is XLA prefetching what the program
        # reads anyway; a copy in device memory duplicates the buffer there.
        kind = ins.kind if ins.memory_space == 0 else ""
        if ins.opcode == "conditional":
            conds += 1
            examples.append(f"conditional {ins.name}")
        elif ins.opcode == "while":
            loops += 1
        elif kind == "copy" and (ins.dtype, math.prod(ins.shape)) in pool_sizes:
            pool += 1
            examples.append(f"pool copy {ins.name} {ins.dtype}{list(ins.shape)}")
        elif (
            kind
            and (ins.dtype, _squeezed(ins.shape)) in weight_shapes
            and math.prod(ins.shape) >= 2**16
            and _reads_a_parameter(ins, by_name)
        ):
            weights += 1
            examples.append(f"weight {kind} {ins.name} {ins.dtype}{list(ins.shape)}")
    return HloFindings(pool, weights, conds, loops, tuple(examples[:6]))


def _squeezed(shape) -> tuple[int, ...]:
    """A shape without its 1s: a stacked weight's row is sliced as [1, in, out]."""
    return tuple(d for d in shape if d != 1)


def _reads_a_parameter(ins: Instruction, by_name: dict) -> bool:
    """Whether one of the operands is, through bitcasts, tuple elements and copies, a
    parameter: a weight as the program (or a loop's body) received it, not an activation
    that happens to have a weight's shape."""
    todo, seen = list(ins.operands), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        src = by_name.get((ins.computation, name))
        if src is None:
            continue
        if src.opcode == "parameter":
            return True
        if src.opcode in _SAME_BUFFER:
            todo.extend(src.operands)
    return False


@dataclasses.dataclass(frozen=True)
class Memory:
    """Per device, bytes: the program's arguments (weights, pool, inputs), outputs, the part of
    the outputs that reuses donated arguments (the pool), temporaries and code."""

    arguments: int
    outputs: int
    donated: int
    temporaries: int
    code: int

    @property
    def peak(self) -> int:
        """What the program holds at once: arguments, outputs not written into a donated
        argument, temporaries and its code."""
        return self.arguments + self.outputs - self.donated + self.temporaries + self.code

    @classmethod
    def of(cls, compiled) -> Memory:
        m = compiled.memory_analysis()
        return cls(
            m.argument_size_in_bytes,
            m.output_size_in_bytes,
            m.alias_size_in_bytes,
            m.temp_size_in_bytes,
            m.generated_code_size_in_bytes,
        )


def cost(compiled) -> dict[str, float]:
    """The compiler's cost analysis (flops, bytes accessed), where it gives one; else {}."""
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # a backend without one (XLA:GPU before a device runs it) raises or
        return {}  # returns None: either way, no cost
    if isinstance(analysis, list):
        analysis = analysis[0] if analysis else None
    if not analysis:
        return {}
    return {k: float(analysis[k]) for k in ("flops", "bytes accessed") if k in analysis}
