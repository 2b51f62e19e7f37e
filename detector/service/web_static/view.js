// The stablewatch web view: follows /events (server-sent events) and puts each view in place.
// Everything it shows comes from the view's JSON (see web_view.py); text goes in as text, and the
// wait-for graph as the SVG the server drew (every name in it escaped there). No library, no
// request anywhere but this detector.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const TIMELINE_SHOWN = 15;

  /** An element with attributes (`text`: its text, `class`: its classes) and children. */
  function el(tag, attributes = {}, ...children) {
    const element = document.createElement(tag);
    for (const [name, value] of Object.entries(attributes)) {
      if (value === null || value === undefined || value === false) continue;
      if (name === "text") element.textContent = String(value);
      else if (name === "class") element.className = value;
      else element.setAttribute(name, value === true ? "" : String(value));
    }
    element.append(...children);
    return element;
  }

  /** A time as text: the time of day when it is today, with the date before it otherwise (the
   * latest snapshot the page shows after a restart may be days old). "–" when there is none. */
  function clock(iso) {
    if (!iso) return "–";
    const time = new Date(iso);
    if (time.toDateString() === new Date().toDateString()) return time.toLocaleTimeString();
    return `${time.toLocaleDateString()} ${time.toLocaleTimeString()}`;
  }

  const millis = (ms) => (ms === null || ms === undefined ? "–" : `${ms < 10 ? ms.toFixed(1) : Math.round(ms)} ms`);
  const plural = (n, word, words = `${word}s`) => `${n} ${n === 1 ? word : words}`;

  function setConnection(state, text) {
    document.body.dataset.connection = state;
    const connection = $("connection");
    connection.dataset.state = state;
    connection.textContent = text;
  }

  function renderSnapshot(snapshot) {
    const id = $("snapshot-id");
    id.textContent = snapshot ? String(snapshot.id) : "–";
    id.dataset.snapshot = snapshot ? String(snapshot.id) : "";
    $("snapshot-meta").textContent = snapshot
      ? `finished ${clock(snapshot.finished_at)} in ${millis(snapshot.duration_ms)} · ` +
        `${plural(snapshot.processes, "process", "processes")}, ${plural(snapshot.channels, "channel")}, ` +
        `${plural(snapshot.messages_in_flight, "message")} in flight · cut ${snapshot.closed ? "closed" : "open"}`
      : "no snapshot has completed yet";
  }

  function renderPredicates(predicates) {
    $("predicates").replaceChildren(
      ...predicates.map((p) =>
        el(
          "li",
          { class: `predicate ${p.value}`, "data-predicate": p.name, "data-value": p.value },
          el("span", { class: "name", text: p.name }),
          el("span", { class: "value", text: p.value }),
          el("p", { class: "summary", text: p.error ? `${p.summary} (error: ${p.error})` : p.summary }),
        ),
      ),
    );
  }

  let drawn = null; // the SVG in place: swapped only when it changes
  function renderGraph(graph) {
    const box = $("graph");
    if (graph.svg !== drawn) {
      box.innerHTML = graph.svg; // drawn and escaped by the server
      drawn = graph.svg;
    }
    box.dataset.snapshot = graph.snapshot_id === null ? "" : String(graph.snapshot_id);
    const notes = [];
    if (graph.snapshot_id !== null) {
      notes.push(`snapshot ${graph.snapshot_id}: ${plural(graph.total_nodes, "node")}`);
      if (graph.nodes.length < graph.total_nodes) notes.push(`${graph.nodes.length} drawn (deadlocked first)`);
      if (graph.cycle.length) notes.push(`deadlock cycle ${[...graph.cycle, graph.cycle[0]].join(" → ")}`);
      if (graph.knot.length) notes.push(`knot {${graph.knot.join(", ")}}`);
      if (graph.separate_deadlocks > 1) notes.push(`${graph.separate_deadlocks} separate deadlocks`);
    }
    $("graph-note").textContent = notes.join(" · ");
    const table = $("channels");
    table.classList.toggle("hidden", graph.channels.length === 0);
    table.tBodies[0].replaceChildren(
      ...graph.channels.map((c) =>
        el(
          "tr",
          { "data-src": c.src, "data-dst": c.dst, "data-messages": c.messages },
          el("td", { text: c.src }),
          el("td", { text: c.dst }),
          el("td", { text: c.messages }),
          el("td", { text: c.waking }),
        ),
      ),
    );
  }

  function renderMembers(members) {
    $("members-count").textContent = `(${members.attached.length} attached)`;
    const rows = members.attached.map((m) =>
      el(
        "li",
        { "data-member": m.process_id, "data-state": "attached", title: `attached ${clock(m.attached_at)}` },
        el("span", { class: "name", text: m.process_id }),
        el("span", { class: "muted", text: ` ${m.address}` }),
      ),
    );
    for (const name of members.missing) {
      rows.push(
        el(
          "li",
          { "data-member": name, "data-state": "missing", title: "expected but not attached" },
          el("span", { class: "name", text: name }),
          el("span", { class: "muted", text: " missing" }),
        ),
      );
    }
    $("members").replaceChildren(...rows);
    const notes = [];
    if (members.expected.length) notes.push(`expected: ${members.expected.join(", ")}`);
    if (members.expected_count) notes.push(`expected ${plural(members.expected_count, "process", "processes")}`);
    if (members.missing_count) notes.push(`${members.missing_count} missing`);
    if (members.cut_missing.length) notes.push(`missing from the latest cut: ${members.cut_missing.join(", ")}`);
    $("members-note").textContent = notes.join(" · ");
  }

  function renderTimeline(timeline, predicates) {
    const names = predicates.map((p) => p.name);
    for (const entry of timeline) {
      for (const name of Object.keys(entry.values)) if (!names.includes(name)) names.push(name);
    }
    const cell = (entry, value, what) =>
      el("span", {
        class: `cell ${value}`,
        "data-snapshot": entry.id,
        "data-value": value,
        title: `snapshot ${entry.id} (${clock(entry.finished_at)}): ${what}`,
      });
    const outcomes = el(
      "div",
      { class: "row", "data-row": "outcome" },
      el("span", { class: "label", text: "snapshots" }),
      ...timeline.map((e) => cell(e, e.outcome, e.outcome === "aborted" ? `aborted: ${e.reason}` : e.outcome)),
    );
    const rows = names.map((name) =>
      el(
        "div",
        { class: "row", "data-row": name },
        el("span", { class: "label", text: name, title: name }),
        ...timeline.map((e) => {
          const value = e.values[name] ?? (e.outcome === "aborted" ? "aborted" : "none");
          return cell(e, value, `${name} ${value}`);
        }),
      ),
    );
    $("strip").replaceChildren(outcomes, ...rows);
    const strip = $("strip");
    strip.scrollLeft = strip.scrollWidth; // the newest snapshots are on the right: keep them in view
    $("timeline").replaceChildren(
      ...timeline
        .slice(-TIMELINE_SHOWN)
        .reverse()
        .map((e) =>
          el(
            "li",
            { "data-snapshot": e.id, "data-outcome": e.outcome, class: e.outcome },
            el("span", { class: "id", text: `#${e.id}` }),
            el("span", { class: "outcome", text: e.outcome }),
            el("span", {
              class: "muted",
              text: ` ${clock(e.finished_at)} · ${millis(e.duration_ms)}` + (e.reason ? ` · ${e.reason}` : ""),
            }),
          ),
        ),
    );
  }

  function renderChanges(changes) {
    $("changes-note").classList.toggle("hidden", changes.length > 0);
    $("changes").replaceChildren(
      ...changes.map((c) =>
        el(
          "li",
          {
            "data-predicate": c.predicate,
            "data-from": c.from ?? "",
            "data-to": c.to,
            "data-snapshot": c.snapshot_id,
          },
          el("span", { class: "muted", text: `${clock(c.at)} ` }),
          el("span", { class: "name", text: c.predicate }),
          el("span", { text: " " }),
          el("span", { class: `value ${c.from ?? "none"}`, text: c.from ?? "first" }),
          el("span", { text: " → " }),
          el("span", { class: `value ${c.to}`, text: c.to }),
          el("span", { class: "muted", text: ` (#${c.snapshot_id})` }),
        ),
      ),
    );
  }

  function renderBreaks(breaks) {
    $("breaks-note").classList.toggle("hidden", breaks.length > 0);
    const table = $("breaks");
    table.classList.toggle("hidden", breaks.length === 0);
    table.tBodies[0].replaceChildren(
      ...breaks.map((b) =>
        el(
          "tr",
          { "data-resolution": b.id, "data-outcome": b.outcome, title: b.detail },
          el("td", { text: b.id }),
          el("td", { text: b.snapshot_id }),
          el("td", { text: `${b.waiter} (wait ${b.instance})` }),
          el("td", { text: b.requested_by === "detector" ? b.policy : b.requested_by }),
          el("td", { class: `outcome ${b.outcome}`, text: b.outcome }),
          el("td", { text: clock(b.sent_at) }),
          el("td", { class: "deadlock", text: b.deadlock }),
        ),
      ),
    );
  }

  function render(view) {
    document.body.dataset.version = String(view.version);
    $("detector").textContent = view.detector;
    renderSnapshot(view.snapshot);
    renderPredicates(view.predicates);
    renderGraph(view.graph);
    renderMembers(view.members);
    renderTimeline(view.timeline, view.predicates);
    renderChanges(view.changes);
    renderBreaks(view.breaks);
  }

  function follow() {
    const source = new EventSource("events");
    source.addEventListener("open", () => setConnection("live", "live"));
    source.addEventListener("view", (event) => {
      setConnection("live", "live");
      render(JSON.parse(event.data));
    });
    source.addEventListener("error", () => {
      if (source.readyState === EventSource.CLOSED) setConnection("closed", "disconnected: reload to try again");
      else setConnection("reconnecting", "reconnecting…");
    });
  }

  follow();
})();
