// Hourglass console: refreshes the panels and sends the operator's actions to the ops API.
// The API token lives in this page's memory (and in sessionStorage only when "keep for this tab"
// is ticked); it is sent only as "Authorization: Bearer" to this origin.
"use strict";
(function () {
  const TOKEN_KEY = "hourglass.console.token";
  let token = sessionStorage.getItem(TOKEN_KEY) || "";
  let pending = null;
  const body = document.body;
  const refreshS = Math.max(2, parseInt(body.dataset.refreshS || "10", 10));
  const $ = (id) => document.getElementById(id);

  function show(text, ok) {
    const out = $("action-result");
    out.textContent = text;  // never innerHTML: server messages may quote user input
    out.className = ok ? "ok" : "bad";
  }

  function request(action) {
    const model = $("action-model").value;
    const version = $("action-version").value.trim();
    switch (action) {
      case "retrain": return ["POST", "/rounds", {}];
      case "promote":
        if (!/^[0-9]+$/.test(version)) { return null; }
        return ["POST", "/promote", { model: model, version: version }];
      case "rollback": return ["POST", "/rollback", { model: model }];
      case "canary-abort": return ["POST", pending.path.replace(/\{\w+\}/g, encodeURIComponent(model)), { model: model }];
    }
    return null;
  }

  async function send(action) {
    const req = request(action);
    if (req === null) { show(action + ": enter a version number first", false); return; }
    const headers = { "Content-Type": "application/json" };
    if (token) { headers["Authorization"] = "Bearer " + token; }
    show(action + ": sending…", true);
    let response;
    try {
      response = await fetch(req[1], { method: req[0], headers: headers, body: JSON.stringify(req[2]), credentials: "same-origin" });
    } catch (err) {
      show(action + " failed: the API did not answer (" + err + ")", false);
      return;
    }
    let detail = "";
    try {
      const data = await response.json();
      detail = typeof data.detail === "string" ? data.detail : JSON.stringify(data.detail !== undefined ? data.detail : data);
    } catch (err) {
      detail = response.statusText;
    }
    if (response.ok) {
      show(action + " accepted (" + response.status + "): " + detail, true);
      refresh();
    } else {
      if (response.status === 401 || response.status === 403) { token = ""; sessionStorage.removeItem(TOKEN_KEY); }
      show(action + " refused (" + response.status + "): " + detail, false);
    }
  }

  function ask(button) {
    pending = { action: button.dataset.action, path: button.dataset.path };
    $("token-question").textContent = button.textContent + ": this changes the service. API token:";
    $("token-input").value = token;
    $("token-dialog").showModal();
    $("token-input").focus();
  }

  $("token-dialog").addEventListener("close", function () {
    const dialog = $("token-dialog");
    if (dialog.returnValue === "ok" && pending) {
      token = $("token-input").value.trim();
      if ($("token-remember").checked && token) { sessionStorage.setItem(TOKEN_KEY, token); }
      send(pending.action);
    }
    $("token-input").value = "";
    dialog.returnValue = "";
  });

  document.querySelectorAll("#action-form button[data-action]").forEach(function (button) {
    button.addEventListener("click", function () { ask(button); });
  });

  async function refresh() {
    if (document.hidden || $("token-dialog").open) { return; }
    try {
      const response = await fetch("/console/panels", { credentials: "same-origin", cache: "no-store" });
      if (!response.ok) { $("refreshed").textContent = "refresh failed (" + response.status + ")"; return; }
      $("panels").innerHTML = await response.text();  // server-rendered, every value escaped there
      $("refreshed").textContent = "refreshed " + new Date().toISOString().slice(11, 19) + " UTC";
    } catch (err) {
      $("refreshed").textContent = "refresh failed: the API did not answer";
    }
  }
  setInterval(refresh, refreshS * 1000);
})();
