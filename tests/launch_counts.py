"""Which Triton kernels a piece of code launches, interpreted (CPU) or compiled (CUDA)."""

from contextlib import contextmanager


@contextmanager
def counting_launches():
    """Yields the list of the names of the kernels launched inside, in launch order."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    names, saved = [], (InterpretedFunction.run, JITFunction.run)

    def counting(original):
        def run(self, *args, **kwargs):
            names.append(self.fn.__name__ if hasattr(self, "fn") else self.__name__)
            return original(self, *args, **kwargs)

        return run

    InterpretedFunction.run, JITFunction.run = counting(saved[0]), counting(saved[1])
    try:
        yield names
    finally:
        InterpretedFunction.run, JITFunction.run = saved


@contextmanager
def launch_arguments(argument):
    """Yields the list of (kernel name, value of its argument ``argument``) of the launches inside, in order."""
    import inspect

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    seen, saved = [], (InterpretedFunction.run, JITFunction.run)

    def recording(original):
        def run(self, *args, **kwargs):
            bound = inspect.signature(self.fn).bind_partial(*args, **{k: v for k, v in kwargs.items()
                                                                      if k in inspect.signature(self.fn).parameters})
            seen.append((self.fn.__name__, bound.arguments.get(argument)))
            return original(self, *args, **kwargs)

        return run

    InterpretedFunction.run, JITFunction.run = recording(saved[0]), recording(saved[1])
    try:
        yield seen
    finally:
        InterpretedFunction.run, JITFunction.run = saved
