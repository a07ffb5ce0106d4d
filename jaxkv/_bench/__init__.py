"""The benchmark harness behind ``python -m jaxkv.bench``: cases, device timing, report, plot."""
