"""Real SGLang servers as the rollout fleet (GPU): launch command, environment, client."""
