"""What if: an incident's own series fitted to a workload and replayed under each remedy.

``fit`` turns an instance's window into a reference-pool ``Scenario`` (arrivals, lengths,
prefix sharing, the pool and the engine's limits, with every assumed knob named);
``deployment`` sizes its pool from the one the engine reported; ``levers`` are the remedies as
changes to a scenario; ``replay`` runs scenarios through the reference engine of the same kind
and reads the result back through the adapters, windows and checklist, so a predicted verdict
comes from the same pipeline as an observed one; ``compare`` states how far a replay is from its
reference; ``scale`` is the scale model; ``pairs`` hold predictions against the scenario run
with the remedy applied (``kvdiag validate``); ``report`` renders it all.
"""
