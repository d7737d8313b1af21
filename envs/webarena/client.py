"""WebArena HTTP clients: the web-agent instruction and ReAct parsing of WebArena's action grammar."""

from __future__ import annotations

from envs.client import AsyncBaseEnvClient, BaseEnvClient, ClientLogic, agentgym_conversation

INSTRUCTION = (
    "You are an autonomous intelligent agent tasked with navigating a web browser. You will be given "
    "web-based tasks. Each turn you see the objective, the current web page's URL, your previous action, the "
    "open tabs and the page's accessibility tree, in which every element has an id in brackets, e.g. [12].\n\n"
    "Actions:\n"
    "click [id]: click the element with that id.\n"
    "type [id] [content] [press_enter_after=0|1]: type content into the field with that id; Enter is pressed "
    "afterwards unless press_enter_after is 0.\n"
    "hover [id]: hover over the element.\n"
    "press [key_comb]: press a key combination, e.g. Control+a.\n"
    "scroll [down] or scroll [up]: scroll the page.\n"
    "new_tab: open a new tab. tab_focus [tab_index]: switch to a tab. close_tab: close the current tab.\n"
    "goto [url]: open a URL. go_back: previous page. go_forward: next page.\n"
    "stop [answer]: finish the task, with the answer if the task asks for one (otherwise stop []).\n\n"
    "Reply in exactly this format, with a single action on the line after 'Action:':\n"
    "Thought:\n<your reasoning>\n\nAction:\n<one action>"
)
ACK = "OK. I'll follow your instructions and try my best to solve the task."


class Spec(ClientLogic):
    """The web-agent prompt; ReAct parsing (one ``Action:``), the action string sent as it is."""

    env_name = "webarena"
    conversation_start = agentgym_conversation(INSTRUCTION, ACK)


class Client(Spec, BaseEnvClient):
    pass


class AsyncClient(Spec, AsyncBaseEnvClient):
    pass
