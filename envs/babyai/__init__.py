"""BabyAI environment: AgentGym's 40 minigrid BabyAI levels as a text game with high-level actions.

``backend`` holds the level list, the server-side :class:`~envs.babyai.backend.Backend` and the episode
class; ``text`` turns minigrid's egocentric view into the observation text and expands high-level
actions ("go to red ball 1") into primitive minigrid actions; ``client`` holds the instruction prompt;
``expert`` plays minigrid's BabyAIBot through the client.
"""
