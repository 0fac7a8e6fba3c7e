"""The MLflow model registry: round runs and adapter versions (:mod:`.models`),
alias moves (:mod:`.aliases`), signatures (:mod:`.signing`) and the reward
model's own registered model (:mod:`.reward_registry`)."""
