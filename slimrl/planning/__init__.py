"""Plans made from config.json and the config alone, before anything starts: the memory of a
training rank (`memory_plan.py`) and of one GPU of an SGLang engine (`engine_plan.py`)."""
