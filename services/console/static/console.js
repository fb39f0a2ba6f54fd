// Baton console: the live parts of its pages, in plain JavaScript (no
// library, no build step). A session page follows its session's events by
// server-sent events from its cursor (and shows the step in flight as it
// runs: its live text) and loads older pages on demand; a deployment page
// follows a running drain.
"use strict";

function refreshHeader() {
  const header = document.getElementById("session-header");
  if (!header || header.dataset.pending) return;
  header.dataset.pending = "1";
  setTimeout(async () => {
    delete header.dataset.pending;
    const answer = await fetch(header.dataset.src, { credentials: "same-origin" });
    if (answer.ok) header.innerHTML = await answer.text();
  }, 300);
}

function followSession(timeline) {
  const live = document.getElementById("live");
  const source = new EventSource(timeline.dataset.follow);
  source.addEventListener("events", (message) => {
    timeline.insertAdjacentHTML("beforeend", message.data);
    if (live) live.textContent = "Following live from #" + message.lastEventId + ".";
    refreshHeader();
  });
  // The step in flight, as it runs (live items): replaced as it grows,
  // cleared when its commit arrives (an empty message).
  source.addEventListener("live", (message) => {
    const draft = document.getElementById("live-step");
    if (!draft) return;
    draft.innerHTML = message.data;
    draft.hidden = !message.data;
  });
  source.addEventListener("end", () => {
    source.close();
    if (live) live.textContent = "The session's stream is closed.";
    refreshHeader();
  });
  source.addEventListener("problem", (message) => {
    source.close();
    if (live) live.textContent = "Stopped following: " + message.data;
  });
}

function loadOlder(button, timeline) {
  button.addEventListener("click", async () => {
    const before = button.dataset.before;
    const answer = await fetch(button.dataset.src + "?before=" + before, {
      credentials: "same-origin",
    });
    if (!answer.ok) return;
    timeline.insertAdjacentHTML("afterbegin", await answer.text());
    const start = Number(answer.headers.get("X-Start-Seq"));
    button.dataset.before = String(start);
    if (timeline.querySelector(".horizon") || start === 0) button.remove();
  });
}

function followDrain(log) {
  const source = new EventSource(log.dataset.follow);
  source.addEventListener("line", (message) => {
    const item = document.createElement("li");
    item.textContent = message.data;
    log.appendChild(item);
  });
  source.addEventListener("done", () => {
    source.close();
    window.location.reload();
  });
}

document.addEventListener("DOMContentLoaded", () => {
  const timeline = document.getElementById("timeline");
  if (timeline && timeline.dataset.follow) followSession(timeline);
  const older = document.getElementById("older");
  if (older && timeline) loadOlder(older, timeline);
  const drain = document.getElementById("drain-log");
  if (drain && drain.dataset.follow) followDrain(drain);
});
