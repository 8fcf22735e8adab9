"""Real vLLM and SGLang servers in the loop: test and validation machinery, never the diagnosis.

``envs`` finds the engines' environments (built by scripts/real-env.sh), ``engines`` starts and
stops a server with a given pool and caps, ``load`` drives it (open and closed loops, shared
prefixes, client-side TTFT), ``truth`` reads what the engine's own scheduler decided (the hook in
``site/``), and ``stories`` runs the real stories and scores kvdiag's verdicts against that truth
as ``kvdiag validate`` scores the simulated ones. Nothing under kvdiag's diagnosis path imports
this package; the tests, ``kvdiag validate --real`` and ``kvdiag demo --real`` do.
"""
