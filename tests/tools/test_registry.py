"""The tool registry and runner: names, errors and timeouts counted, never raised."""

from __future__ import annotations

import logging
import textwrap
import threading

import pytest
from PIL import Image

from r1fit.tools import (
    BUILTIN_TOOLS,
    ToolCall,
    ToolConfigError,
    ToolContext,
    ToolCounts,
    ToolResult,
    ToolRunner,
    ToolStats,
    crop,
    resolve_tool,
    zoom,
)

RELEASE = threading.Event()  # the slow plugin tool waits for it


@pytest.fixture
def plugin(tmp_path, monkeypatch) -> str:
    (tmp_path / "my_tools_plugin.py").write_text(textwrap.dedent("""
        from PIL import Image
        import tests.tools.test_registry as here

        def describe(context, word="x"):
            return f"{len(context.images)} image(s), {word}"

        def both(context):
            return ["left:", Image.new("RGB", (400, 100)), "done"]

        def broken(context, **arguments):
            raise KeyError("oops")

        def slow(context):
            here.RELEASE.wait(10)
            return "late"

        def nothing(context):
            return None

        def empty(context):
            return []

        def no_context():
            return "x"

        def surrogate(context):
            return ["fine", b"bad \\xff text".decode("utf-8", "surrogateescape")]

        def truncated(context):  # a lazily opened image: decoded only when it is used
            import io
            buffer = io.BytesIO()
            Image.new("RGB", (64, 64), "red").save(buffer, "PNG")
            return Image.open(io.BytesIO(buffer.getvalue()[:80]))

        class Unprintable(Exception):
            def __str__(self):
                raise ValueError("no str")

        def unprintable(context):
            raise Unprintable()

        NOT_CALLABLE = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_tools_plugin"


def runner(*specs: str, timeout: float = 5.0) -> ToolRunner:
    return ToolRunner(specs, timeout=timeout, min_pixels=28 * 28, max_pixels=56 * 56)


CONTEXT = ToolContext((Image.new("RGB", (224, 224), "white"),))


def call(name: str, **arguments) -> ToolCall:
    return ToolCall(name, arguments, "")


class TestResolve:
    def test_builtins(self):
        assert BUILTIN_TOOLS == {"crop": crop, "zoom": zoom}
        assert resolve_tool("zoom") == ("zoom", zoom)

    def test_a_plugin_is_called_by_its_function_name(self, plugin):
        name, fn = resolve_tool(f"{plugin}:describe")
        assert name == "describe"
        assert fn(CONTEXT) == "1 image(s), x"

    @pytest.mark.parametrize(("spec", "message"), [
        ("crpo", "unknown tool 'crpo': use a built-in (crop, zoom) or 'package.module:function'"),
        ("no_such_tools_xyz:fn", "tool 'no_such_tools_xyz:fn': module 'no_such_tools_xyz' not "
                                 "found on sys.path"),
        ("my_tools_plugin:missing", "has no attribute 'missing'"),
        ("my_tools_plugin:NOT_CALLABLE", "'NOT_CALLABLE' is a int, not a function"),
        ("my_tools_plugin:no_context", "must take the row's context first"),
        ("my_tools_plugin:", "expected 'package.module:function'"),
        ("", "non-empty string"),
    ])
    def test_bad_specs_are_one_line_config_errors(self, plugin, spec, message):
        with pytest.raises(ToolConfigError) as excinfo:
            resolve_tool(spec)
        assert message in str(excinfo.value)
        assert "\n" not in str(excinfo.value)

    def test_two_tools_of_one_name_are_refused(self, plugin, tmp_path):
        (tmp_path / "other_tools_plugin.py").write_text("def crop(context):\n    return 'x'\n")
        with pytest.raises(ToolConfigError, match="another tool is already called 'crop'"):
            runner("crop", "other_tools_plugin:crop")

    def test_the_timeout_must_be_positive(self):
        with pytest.raises(ToolConfigError, match="timeout must be > 0"):
            ToolRunner(["crop"], timeout=0, min_pixels=784, max_pixels=3136)


class TestRun:
    def test_an_image_result_is_fitted_to_the_pixel_budget(self):
        tools = runner("crop")
        result = tools.run(call("crop", x1=0, y1=0, x2=1, y2=0.5), CONTEXT)
        assert not result.error
        (image,) = result.parts
        # 224 x 112 cut from the 224 px image, shrunk into 56 * 56 = 3136 pixels: scale
        # sqrt(3136 / 25088) gives 79.2 x 39.6; short side 39 -> long 79 (<= 3136 // 39 = 80,
        # ratio 2.026), 40 -> long 78 (3136 // 40, ratio 1.95): 79 x 39 is nearer 2:1
        assert image.size == (79, 39)

    def test_text_and_images_in_order(self, plugin):
        result = runner(f"{plugin}:both").run(call("both"), CONTEXT)
        assert result.parts[0] == "left:" and result.parts[2] == "done"
        assert result.parts[1].size[0] * result.parts[1].size[1] <= 56 * 56  # 400 x 100 shrunk

    def test_failures_are_error_results_and_counted(self, plugin, caplog):
        tools = runner("crop", f"{plugin}:broken", f"{plugin}:nothing", f"{plugin}:empty")
        results = [
            tools.run(call("crop", x1=0, y1=0, x2=1.2, y2=1), CONTEXT),  # bad value
            tools.run(call("crop", x1=0, y1=0, x2=1, y2=1, colour="red"), CONTEXT),  # bad name
            tools.run(call("crop", x1=0, y1=0, x2=1, y2=1), CONTEXT),  # fine
            tools.run(call("rotate"), CONTEXT),  # unknown tool
            tools.run(call("broken"), CONTEXT),
            tools.run(call("broken", a=1), CONTEXT),
            tools.run(call("nothing"), CONTEXT),
            tools.run(call("empty"), CONTEXT),
        ]
        assert [r.error for r in results] == [True, True, False, True, True, True, True, True]
        texts = [r.parts[0] for r in results if r.error]
        assert texts == [
            "error: crop: x2=1.2 is outside [0, 1] (coordinates are fractions of the image's "
            "width and height)",
            "error: crop: bad arguments ['colour', 'x1', 'x2', 'y1', 'y2']: got an unexpected "
            "keyword argument 'colour'",
            "error: unknown tool 'rotate' (tools: broken, crop, empty, nothing)",
            "error: broken: raised KeyError: 'oops'",
            "error: broken: raised KeyError: 'oops'",
            "error: nothing: returned NoneType; expected text, a PIL image or a list of them",
            "error: empty: returned an empty list",
        ]
        stats = tools.stats
        assert stats.tools == {"crop": ToolCounts(3, 2, 0), "broken": ToolCounts(2, 2, 0),
                               "nothing": ToolCounts(1, 1, 0), "empty": ToolCounts(1, 1, 0)}
        assert stats.malformed == 1
        # the tool's own bug is logged once with its traceback; bad arguments are not logged
        logged = [r.getMessage() for r in caplog.records if r.name == "r1fit.tools"]
        assert len(logged) == 1 and "KeyError: 'oops'" in logged[0]

    def test_results_a_run_cannot_use_are_error_results_naming_the_tool(self, plugin):
        # each of these killed the run before (a tokenizer TypeError, PIL's OSError at resize,
        # the error handler's own ValueError), instead of failing the one call
        tools = runner(f"{plugin}:surrogate", f"{plugin}:truncated", f"{plugin}:unprintable")
        texts = [tools.run(call(name), CONTEXT).parts
                 for name in ("surrogate", "truncated", "unprintable")]
        assert texts[0] == ("error: surrogate: returned text that is not valid Unicode "
                            "(surrogates not allowed at character 4)",)
        assert texts[1][0].startswith("error: truncated: returned an image that cannot be "
                                      "decoded: OSError: ")  # PIL's words: image file is truncated
        assert texts[2] == ("error: unprintable: raised Unprintable: Unprintable",)
        assert tools.stats.tools == {name: ToolCounts(1, 1, 0)
                                     for name in ("surrogate", "truncated", "unprintable")}

    def test_a_tool_past_its_timeout_is_abandoned_and_counted(self, plugin):
        RELEASE.clear()
        tools = runner(f"{plugin}:slow", timeout=0.05)
        result = tools.run(call("slow"), CONTEXT)
        assert result == ToolResult("slow", ("error: slow: timed out after 0.05 s",), error=True)
        assert tools.stats.tools["slow"] == ToolCounts(calls=1, errors=0, timeouts=1)
        assert tools.stats.stuck == 1  # its thread still runs: threads cannot be killed
        RELEASE.set()
        tools.stats._abandoned[0].join(5)
        assert tools.stats.stuck == 0

    def test_run_text_parses_and_runs_every_call(self):
        tools = runner("zoom")
        results = tools.run_text('<tool_call>{"name": "zoom", "arguments": {"x": 0.5, "y": 0.5}}'
                                 "</tool_call>and<tool_call>{nope}</tool_call>", CONTEXT)
        assert [r.error for r in results] == [False, True]
        assert results[1].name == ""
        assert results[1].parts[0].startswith("error: tool call is not valid JSON")
        assert tools.stats.malformed == 1


def test_stats_metrics():
    stats = ToolStats(tools={"zoom": ToolCounts(4, 1, 2), "crop": ToolCounts(3, 0, 0)},
                      malformed=5, seconds=1.5)
    assert stats.metrics() == {
        "tools/crop/calls": 3.0, "tools/crop/errors": 0.0, "tools/crop/timeouts": 0.0,
        "tools/zoom/calls": 4.0, "tools/zoom/errors": 1.0, "tools/zoom/timeouts": 2.0,
        "tools/malformed": 5.0, "tools/stuck": 0.0, "tools/seconds": 1.5}


def test_calls_from_many_threads_are_each_counted_once(plugin):
    """run() is called by a turn's rows at once (rollout.tool_workers): every call, error and
    malformed call is counted exactly once, and a broken tool's traceback logged once."""
    tools = runner("zoom", f"{plugin}:broken")
    calls = [call("zoom", x=0.5, y=0.5), call("broken"), call("nope"), call("zoom", x=2)] * 50
    start = threading.Barrier(8)

    def worker(k: int) -> None:
        start.wait(5)
        for c in calls[k::8]:
            tools.run(c, CONTEXT)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    stats = tools.stats
    assert (stats.tools["zoom"].calls, stats.tools["zoom"].errors) == (100, 50)
    assert (stats.tools["broken"].calls, stats.tools["broken"].errors) == (50, 50)
    assert stats.malformed == 50
    assert tools._logged == {"broken"}


def test_logging_is_quiet_for_a_clean_call(caplog):
    caplog.set_level(logging.DEBUG, logger="r1fit.tools")
    runner("zoom").run(call("zoom", x=0.5, y=0.5), CONTEXT)
    assert not caplog.records
