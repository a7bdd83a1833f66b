"""A models directory served on demand (`kvgate serve --models-dir DIR`), as Ollama
serves its models: what the directory holds (scan), which resident models make room for
another (budget), and the component that loads, keeps alive and unloads them (resident).
The routes and the serving path reach it only through `held`.
"""

from gateway.ondemand.resident import DEFAULT, UNCHANGED, Held, ModelsDir, held, of

__all__ = ["DEFAULT", "UNCHANGED", "Held", "ModelsDir", "held", "of"]
