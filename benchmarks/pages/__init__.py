"""The results page's sections, one module per benchmark.

A module here that defines ``RESULTS`` (the result names it renders: a result JSON's ``name`` field) and
``render(result, results_dir) -> Rendered`` renders those results' sections; ``benchmarks.results_page``
finds it by that, with no list to update. Any other result gets the generic section (``generic``).
Shared types, number formatting and plotting helpers are in ``common``.
"""
