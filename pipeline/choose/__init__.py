"""``python -m pipeline choose``: cut, bits, method and arch chosen under a memory and a time budget.

- :mod:`.space`: the knobs, ``--space KEY=V1,V2`` and the candidates (dicts of overrides);
- :mod:`.meter`: every candidate checked and its training memory metered, before any training;
- :mod:`.halving`: successive halving, each training a run of the recipe in one shared store;
- :mod:`.search`: the whole search (:func:`~pipeline.choose.search.choose`);
- :mod:`.report`: the explored frontier, ``choose.json``/``choose.md`` and the winner's recipe;
- :mod:`.command`: the command line.
"""
