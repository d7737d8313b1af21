"""Environments as HTTP servers (AgentGym's wire protocol) and their clients.

``envs.server`` serves any :class:`envs.base.Backend`; ``envs.client`` holds ``BaseEnvClient`` (sync and
async); one subpackage per environment (babyai, textcraft, sciworld, webarena, deepsearch) provides a
backend, a client with its instruction prompt, and an expert. Never imports Prefect or DVC.
"""
