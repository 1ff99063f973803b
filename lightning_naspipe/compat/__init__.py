"""The one home of the private Lightning, torch and Python names NASPipe reaches, and of its runtime patches.

One module per dependency: :mod:`.lightning` (Lightning's internals, its patches and the setup guard
``check_internals``), :mod:`.torch` (torch's), :mod:`.python` (CPython's and NumPy's generators) and :mod:`.malloc`
(glibc's malloc settings while modules are timed on the CPU). The rest
of the package calls their named accessors, so a private name or a patch outside this subpackage is a defect
(``tests/test_private_apis.py`` scans for them; docs/design.md's table lists each with its guard).

Layering (``tests/test_layers.py``): the base. Every layer may import :mod:`.torch`, :mod:`.python` and :mod:`.malloc`;
only ``integration`` and the entry points may import :mod:`.lightning`, the one module outside
``integration`` that imports a Lightning namespace.
"""
