"""Live capture from training frameworks that run in this process.

``capture.integrations.trl`` — TRL's ``GRPOTrainer`` (needs the ``[trl]`` extra: ``pip install -e '.[trl]'``).
Nothing is imported here, so ``import capture`` never pulls in a framework.
"""
