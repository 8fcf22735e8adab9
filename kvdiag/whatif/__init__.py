"""What if: an incident's own series fitted to a workload and replayed under each remedy.

``fit`` turns an instance's window into a reference-pool ``Scenario`` (arrivals, lengths,
prefix sharing, the pool and the engine's limits, with every assumed knob named); ``levers``
are the remedies as changes to that scenario; ``replay`` runs it through the reference engine
of the same kind and reads the result back through the adapters, windows and checklist, so a
predicted verdict comes from the same pipeline as an observed one; ``pairs`` hold the
prediction against the scenario run with the remedy applied (``kvdiag validate``).
"""
