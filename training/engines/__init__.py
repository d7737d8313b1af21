"""The policy engines: who generates a rollout's replies. ``engine`` (the interface, transformers' ``generate``
in this process), ``chat_engine`` (a model behind a chat API), ``vllm_engine`` (a vLLM server), ``vllm_server``
(starting and stopping that server process), ``weight_sync`` (the trainer's new weights into the server after
every update) and ``vllm_worker`` (the server side of that sync, loaded by vLLM itself). They know nothing of the
trainer: the import contracts keep the trainer, rollouts and stages out of this package.
"""
