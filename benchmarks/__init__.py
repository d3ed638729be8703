"""peftlab's benchmarks: what methods and the data path cost (time, memory, parameters, model FLOP utilisation),
recorded as JSON and Markdown. Outside the installed package, driven by peftlab's public API; run from a source
checkout, one small command line per benchmark (docs/BENCHMARKS.md):

* ``micro.py`` (every method's cost on one model, on :mod:`benchmarks.micro_rows`), ``e2e.py`` (the data path
  end to end), ``against_trainer.py`` (GLUE, :mod:`benchmarks.trainer_worker`) and ``against_trainer_decoder.py``
  (decoders, :mod:`benchmarks.decoder_worker`) side by side on :mod:`benchmarks.pairs` and
  :mod:`benchmarks.worker`, ``sweep_overhead.py``, ``decode.py``; ``rerender.py`` rebuilds a table from its JSON;
* shared: :mod:`benchmarks.cli` (flags, one-line errors), :mod:`benchmarks.timing`, :mod:`benchmarks.memory`,
  :mod:`benchmarks.machine`, :mod:`benchmarks.models`, :mod:`benchmarks.flops` (``FlopCounterMode`` on a
  meta-device copy) and :mod:`benchmarks.peak` (the measured GEMM peak), :mod:`benchmarks.render`.
"""
