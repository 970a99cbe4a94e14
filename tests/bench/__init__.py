"""The benchmarks, each a module run as ``PYTHONPATH=tests python -m bench.<name>``.

``tests/`` on the path (as pytest's ``pythonpath`` puts it) makes ``bench.*`` and
``support.*`` importable without editing ``sys.path``; ``tests/benchsmoke`` and
``tests/vllm/test_vllm_benchmarks.py`` call each one at a tiny size.
"""
