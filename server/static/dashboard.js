// The dashboard: a streaming chat over /v1/chat/completions and live panels from GET /stats.
// Plain browser JavaScript, no dependencies. The API key lives in the key field only: it is sent as a
// bearer token with each chat request and each /stats read, and never written anywhere.
"use strict";

const $ = (id) => document.getElementById(id);
const POLL_MS = 1000;
const HISTORY = 60; // tokens/s samples kept for the chart

const chat = { messages: [], controller: null };
const live = { previous: null, rates: [] };

// ---- chat --------------------------------------------------------------------------------------

function addMessage(role, text) {
  const element = document.createElement("div");
  element.className = `message ${role}`;
  const who = document.createElement("span");
  who.className = "who";
  who.textContent = role;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  element.append(who, body);
  $("transcript").append(element);
  $("transcript").scrollTop = $("transcript").scrollHeight;
  return body;
}

// The key as a bearer token, for the chat and for /stats (which needs it when the server protects its metrics).
function authorization() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

function headers() {
  return { "Content-Type": "application/json", ...authorization() };
}

async function errorText(response) {
  try {
    const body = await response.json();
    return body.error?.message || JSON.stringify(body);
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

// Server-sent events: "data: <json>" lines, events separated by a blank line, ending with [DONE].
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function send(question) {
  $("chat-error").textContent = "";
  chat.messages.push({ role: "user", content: question });
  addMessage("user", question);
  const target = addMessage("assistant", "");
  target.parentElement.classList.add("streaming");
  chat.controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  let answer = "";
  let reasoning = ""; // a reasoning model's thinking, shown above the answer and not sent back
  let thinking = null;
  try {
    const maxTokens = parseInt($("max-tokens").value, 10);
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: chat.controller.signal,
      body: JSON.stringify({ messages: chat.messages, stream: true,
                             ...(maxTokens > 0 ? { max_tokens: maxTokens } : {}) }),
    });
    if (!response.ok) {
      const message = await errorText(response);
      if (response.status === 401) {
        $("api-key").focus();
        throw new Error(`this server needs an API key: enter it above (${message})`);
      }
      throw new Error(message);
    }
    for await (const event of events(response)) {
      if (event.error) throw new Error(event.error.message);
      const thought = event.choices?.[0]?.delta?.reasoning_content;
      if (thought) {
        if (!thinking) {
          thinking = document.createElement("span");
          thinking.className = "thinking";
          target.before(thinking);
        }
        reasoning += thought;
        thinking.textContent = reasoning;
      }
      const delta = event.choices?.[0]?.delta?.content;
      if (delta) {
        answer += delta;
        target.textContent = answer;
        $("transcript").scrollTop = $("transcript").scrollHeight;
      }
    }
    chat.messages.push({ role: "assistant", content: answer });
  } catch (error) {
    if (error.name !== "AbortError") $("chat-error").textContent = error.message;
    chat.messages.pop(); // no complete answer: the question leaves the history (its text stays on screen)
  } finally {
    target.parentElement.classList.remove("streaming");
    target.parentElement.classList.add("done");
    chat.controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

$("chat-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const question = $("question").value.trim();
  if (!question || chat.controller) return;
  $("question").value = "";
  send(question);
});
$("question").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("chat-form").requestSubmit();
  }
});
$("stop").addEventListener("click", () => chat.controller?.abort());
$("clear").addEventListener("click", () => {
  chat.messages = [];
  $("transcript").replaceChildren();
});

// ---- live panels -------------------------------------------------------------------------------

const percent = (x) => (x === null || x === undefined ? "–" : `${(100 * x).toFixed(0)}%`);
const millis = (x) => (x === null || x === undefined ? "–" : `${(1000 * x).toFixed(x < 0.01 ? 1 : 0)} ms`);

function latencyText(summary) {
  if (!summary || !summary.count) return "no requests yet";
  return `p50 ${millis(summary.p50)} · p90 ${millis(summary.p90)} · p99 ${millis(summary.p99)} (${summary.count})`;
}

function drawChart() {
  const canvas = $("tokens-chart");
  const context = canvas.getContext("2d");
  const { width, height } = canvas;
  context.clearRect(0, 0, width, height);
  const rates = live.rates;
  if (rates.length < 2) return;
  const top = Math.max(...rates, 1);
  context.strokeStyle = "#2f6fde";
  context.lineWidth = 2;
  context.beginPath();
  rates.forEach((rate, i) => {
    const x = (i / (HISTORY - 1)) * width;
    const y = height - 2 - (rate / top) * (height - 4);
    if (i === 0) context.moveTo(x, y); else context.lineTo(x, y);
  });
  context.stroke();
}

function renderPhases(seconds) {
  const phases = ["schedule", "prepare", "forward", "sample"];
  const total = phases.reduce((sum, phase) => sum + (seconds[phase] || 0), 0);
  $("phases").replaceChildren(...phases.map((phase) => {
    const share = total > 0 ? (seconds[phase] || 0) / total : 0;
    const row = document.createElement("div");
    row.className = "row";
    row.dataset.phase = phase;
    const bar = document.createElement("div");
    bar.className = "bar";
    const fill = document.createElement("div");
    fill.style.width = `${(100 * share).toFixed(1)}%`;
    bar.append(fill);
    const name = document.createElement("span");
    name.textContent = phase;
    const value = document.createElement("span");
    value.textContent = percent(share);
    row.append(name, bar, value);
    return row;
  }));
}

function render(stats) {
  $("status").textContent = stats.ready ? "ready" : "not ready";
  $("status").className = `status ${stats.ready ? "ok" : "down"}`;
  if (stats.model) {
    const m = stats.model;
    $("model").textContent = `${m.name} · ${m.precision} on ${m.device} · max ${m.max_num_seqs} sequences`;
  }
  const e = stats.engine;
  if (e) {
    if (live.previous && live.previous.engine) {
      const seconds = stats.time - live.previous.time;
      const tokens = e.num_generation_tokens - live.previous.engine.num_generation_tokens;
      const rate = seconds > 0 ? tokens / seconds : 0;
      live.rates.push(rate);
      if (live.rates.length > HISTORY) live.rates.shift();
      $("tokens-per-s").textContent = rate.toFixed(1);
      drawChart();
    }
    $("running").textContent = e.num_running;
    $("waiting").textContent = e.num_waiting;
    $("kv-usage").textContent = percent(e.kv_usage);
    $("kv-bar").style.width = `${(100 * e.kv_usage).toFixed(1)}%`;
    $("prefix-hit").textContent = e.prefix_queries ? percent(e.prefix_hits / e.prefix_queries) : "–";
    renderPhases(e.step_seconds);
  }
  $("ttft").textContent = latencyText(stats.latency.ttft);
  $("itl").textContent = latencyText(stats.latency.itl);
  live.previous = stats;
}

async function poll() {
  try {
    const response = await fetch("/stats", { cache: "no-store", headers: authorization() });
    if (response.status === 401) { // the server protects its figures: the key field unlocks them
      $("status").textContent = "enter the API key to see the server's figures";
      $("status").className = "status down";
      return;
    }
    if (!response.ok) throw new Error(await errorText(response));
    render(await response.json());
  } catch (error) {
    $("status").textContent = `unreachable: ${error.message}`;
    $("status").className = "status down";
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
