"""Which Triton kernels a piece of code launches, interpreted (CPU) or compiled (CUDA)."""

import inspect
from contextlib import contextmanager


@contextmanager
def _recording(record):
    """Calls ``record(kernel, args, kwargs)`` at every Triton launch inside, before the launch."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    saved = (InterpretedFunction.run, JITFunction.run)

    def recorded(original):
        def run(self, *args, **kwargs):
            record(self, args, kwargs)
            return original(self, *args, **kwargs)

        return run

    InterpretedFunction.run, JITFunction.run = recorded(saved[0]), recorded(saved[1])
    try:
        yield
    finally:
        InterpretedFunction.run, JITFunction.run = saved


def _name(kernel) -> str:
    return kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__


@contextmanager
def counting_launches():
    """Yields the list of the names of the kernels launched inside, in launch order."""
    names = []
    with _recording(lambda kernel, args, kwargs: names.append(_name(kernel))):
        yield names


@contextmanager
def launch_arguments(argument):
    """Yields the list of (kernel name, value of its argument ``argument``) of the launches inside, in order."""
    seen = []

    def record(kernel, args, kwargs):
        parameters = inspect.signature(kernel.fn).parameters
        bound = inspect.signature(kernel.fn).bind_partial(*args, **{k: v for k, v in kwargs.items() if k in parameters})
        seen.append((_name(kernel), bound.arguments.get(argument)))

    with _recording(record):
        yield seen
