"""Agent frameworks against `serve --http-port --enable-auto-tool-choice --tool-call-parser
hermes`, unchanged: a smolagents `ToolCallingAgent` (which sends tool_choice "required" on
every step), an openai-agents `Agent` on its chat-completions model and langchain-openai's
`bind_tools` run a tool loop with a tiny random model and finish. Tool arguments are enums, so a random model's calls stay short;
every call must parse, reach the tool and come back as the framework expects."""

from __future__ import annotations

import importlib.resources
from typing import ClassVar, Literal

import yaml

from tests.e2e.http_helpers import AGENT_MODEL_NAME

CITIES = ("Paris", "Tokyo")
calls_made: list[str] = []


def get_weather(city: Literal["Paris", "Tokyo"]) -> str:
    """Get the weather in a city.

    Args:
        city: The city.
    """
    calls_made.append(city)
    return f"22 degrees in {city}"


def test_a_smolagents_tool_calling_agent_runs_its_loop(agent_server):
    from smolagents import OpenAIServerModel, Tool, ToolCallingAgent, tool
    from smolagents.memory import ActionStep
    from smolagents.utils import AgentMaxStepsError

    class FinalAnswer(Tool):
        name = "final_answer"
        description = "Gives the final answer."
        inputs: ClassVar[dict] = {"answer": {"type": "string", "description": "the answer",
                                             "enum": ["sunny", "rainy"]}}
        output_type = "string"

        def forward(self, answer: str) -> str:
            return answer

    templates = yaml.safe_load(importlib.resources.files("smolagents.prompts").joinpath(
        "toolcalling_agent.yaml").read_text())
    templates["system_prompt"] = "You solve tasks with tools. Call a tool at every step."
    model = OpenAIServerModel(model_id=AGENT_MODEL_NAME, api_base=f"{agent_server.http_url}/v1",
                              api_key="unused", max_tokens=96)
    agent = ToolCallingAgent(tools=[tool(get_weather), FinalAnswer()], model=model, max_steps=3,
                             prompt_templates=templates, verbosity_level=0)
    calls_made.clear()
    answer = agent.run("What is the weather in Paris?")
    steps = [s for s in agent.memory.steps if isinstance(s, ActionStep)]
    if isinstance(steps[-1].error, AgentMaxStepsError):
        steps = steps[:-1]  # no final_answer call in 3 steps: smolagents asks for one in text
    assert steps and all(s.error is None for s in steps), [s.error for s in steps]
    called = [c.name for s in steps for c in s.tool_calls or []]
    assert called and set(called) <= {"get_weather", "final_answer"}, called
    assert set(calls_made) <= set(CITIES) and called.count("get_weather") == len(calls_made)
    if called[-1] == "final_answer":
        assert answer in ("sunny", "rainy")


def run_weather_agent(agent_server, model_class: str, **settings):
    """An openai-agents `Agent` whose first turn must call get_weather, on `model_class`
    (`OpenAIChatCompletionsModel` or `OpenAIResponsesModel`); checks the call reached the
    tool and the run finished; its result."""
    import agents
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=f"{agent_server.http_url}/v1", api_key="unused")
    model = getattr(agents, model_class)(model=AGENT_MODEL_NAME, openai_client=client)
    agent = agents.Agent(name="weather", instructions="Answer with the tool's result.",
                         tools=[agents.function_tool(get_weather)], model=model,
                         model_settings=agents.ModelSettings(tool_choice="get_weather",
                                                             max_tokens=96, **settings))
    calls_made.clear()
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert len(calls_made) == 1 and calls_made[0] in CITIES
    assert result.new_items[1].output == f"22 degrees in {calls_made[0]}"
    assert isinstance(result.final_output, str)  # the second turn: "auto", a random answer
    return result


def test_an_openai_agents_agent_calls_its_tool_and_finishes(agent_server):
    run_weather_agent(agent_server, "OpenAIChatCompletionsModel")


def test_langchain_openai_bind_tools_runs_a_two_step_loop(agent_server):
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=AGENT_MODEL_NAME, base_url=f"{agent_server.http_url}/v1",
                     api_key="unused", max_tokens=96, max_retries=0)
    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    question = HumanMessage("What is the weather in Paris?")
    reply = bound.invoke([question])
    assert isinstance(reply, AIMessage)
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in CITIES and call["id"]
    observation = ToolMessage(get_weather(**call["args"]), tool_call_id=call["id"])
    final = llm.bind_tools([get_weather]).invoke([question, reply, observation])
    assert isinstance(final, AIMessage) and isinstance(final.content, str)
