"""Faster forms of three Triton-interpreter internals, installed by tests/conftest.py: the kernel
tests' results are unchanged, they only take less time (tests/test_interpreter_speedups.py checks
each form against the interpreter's own on the same inputs).

- `ReduceOps.generic_reduce` / `ScanOps.generic_scan` (every `tl.reduce` / `tl.associative_scan`
  whose combine function is not one of triton's sum, max, min or argmax: `tl.sort`'s `xor_sum`,
  dInfer's max scan) fold one element at a time in Python. The same left fold, run over whole
  slices (the combine function applied to every other index at once), makes the same combine
  calls on the same values for every element, in the same order: combine functions are
  elementwise. `tl.sort` of 2048 keys went from seconds to milliseconds.
- `_patch_builtin`, run at every call of a `@triton.jit` helper inside a kernel, lists a language
  module's members with `inspect.getmembers` each time to find the builtins it wraps. Which
  attributes those are never changes (a patch replaces a builtin, a restore puts it back), so the
  names are listed once, here, before any kernel ran; each call still wraps exactly the attributes
  that are builtins at that moment.
"""
from __future__ import annotations

import inspect

import numpy as np


def _fold(to_tensor, tensor_type, combine, inputs: list, dtypes: list, keep) -> list:
    """`acc = combine(acc, x[i])` along the leading axis of the arrays `inputs` (one per operand), every other
    index at once, each result cast to its operand's dtype as the interpreter stores it; `keep(i, acc)` sees
    every accumulator. Returns the last."""
    def wrap(values):
        return tuple(to_tensor(np.array(v), dtypes[j]) for j, v in enumerate(values))

    acc = [np.array(d[0]) for d in inputs]
    keep(0, acc)
    for i in range(1, inputs[0].shape[0]):
        out = combine.fn(*wrap(acc), *wrap([d[i] for d in inputs]))
        acc = []
        for j, value in enumerate(out if isinstance(out, tuple) else (out,)):
            value = np.asarray(value.handle.data if isinstance(value, tensor_type) else value)
            target = inputs[j].shape[1:]
            if value.shape != target and value.size == 1:   # a scalar result is stored as a [1] array
                value = value.reshape(())
            acc.append(np.broadcast_to(value, target).astype(inputs[j].dtype))
        keep(i, acc)
    return acc


def install() -> bool:
    """Install the three forms; False (nothing changed) on a triton whose interpreter lacks what they replace."""
    from triton.runtime import interpreter
    import triton.language as tl

    needed = ((interpreter.ReduceOps, "generic_reduce"), (interpreter.ReduceOps, "unravel"),
              (interpreter.ScanOps, "generic_scan"), (interpreter, "_patch_builtin"), (interpreter, "_patch_attr"),
              (tl.core, "tensor_descriptor_base"), (tl.core, "is_builtin"))
    if not all(hasattr(owner, name) for owner, name in needed):
        return False

    def generic_reduce(self, input):
        original_axis = self.axis
        input, axis = self.unravel(input, self.axis)
        shape = input[0].handle.data.shape
        moved = [np.moveaxis(arg.handle.data, axis, 0) for arg in input]
        acc = _fold(self.to_tensor, tl.core.tensor, self.combine_fn, moved, [arg.dtype for arg in input],
                    lambda i, a: None)
        ret = []
        for i, data in enumerate(acc):
            data = np.asarray(data, dtype=moved[i].dtype)
            if self.keep_dims:
                if original_axis is not None:
                    data = np.expand_dims(data, axis)
                else:
                    for _ in range(len(shape)):
                        data = np.expand_dims(data, 0)
            elif original_axis is None:
                data = data.item()
            ret.append(self.to_tensor(data, input[i].dtype))
        return ret

    def generic_scan(self, input):
        moved = [np.moveaxis(arg.handle.data, self.axis, 0) for arg in input]
        outputs = [np.zeros(m.shape, dtype=m.dtype) for m in moved]

        def keep(i, acc):
            for j, a in enumerate(acc):
                outputs[j][i] = a

        _fold(self.to_tensor, tl.core.tensor, self.combine_fn, moved, [arg.dtype for arg in input], keep)
        return [self.to_tensor(np.ascontiguousarray(np.moveaxis(o, 0, self.axis)), input[i].dtype)
                for i, o in enumerate(outputs)]

    builtin_names = {}
    for pkg in (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base):
        builtin_names[id(pkg)] = [name for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)]
    original_patch_builtin = interpreter._patch_builtin

    def patch_builtin(pkg, builder, scope):
        names = builtin_names.get(id(pkg))
        if names is None:
            return original_patch_builtin(pkg, builder, scope)
        for name in names:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    interpreter.ReduceOps.original_generic_reduce = interpreter.ReduceOps.generic_reduce
    interpreter.ScanOps.original_generic_scan = interpreter.ScanOps.generic_scan
    interpreter.original_patch_builtin = original_patch_builtin
    interpreter.ReduceOps.generic_reduce = generic_reduce
    interpreter.ScanOps.generic_scan = generic_scan
    interpreter._patch_builtin = patch_builtin
    return True
