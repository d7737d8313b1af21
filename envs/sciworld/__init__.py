"""SciWorld (ScienceWorld) environment: a pooled-JVM backend over AgentGym's task index, the AgentGym-style
ReAct client with its instruction prompt, and a gold-path expert that plays through HTTP."""
