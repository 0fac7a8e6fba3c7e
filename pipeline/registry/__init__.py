"""The MLflow model registry: round runs and adapter versions (:mod:`.models`),
alias moves (:mod:`.aliases`), signatures (:mod:`.signing`) and the reward
model's own registered model (:mod:`.reward_registry`). The leaf
:mod:`.client` (the MLflow client factory, the registry errors, the shared tag
names) imports none of them; ``models`` imports ``aliases``, never the other way."""
