import { act, button, errorView, h, modelPickerView, rerender, watch } from "./shared.js";

function copyButton(text, index) {
  return button(
    "Copy",
    "Copy this answer",
    async (e) => {
      const target = e.currentTarget;
      try {
        await navigator.clipboard.writeText(text);
        target.textContent = "Copied";
      } catch {
        target.textContent = "Copy failed";
      }
    },
    { "data-key": `copy:${index}` },
  );
}

function message(msg, index, live = false) {
  const assistant = msg.role === "assistant";
  return h(
    "div",
    { className: `lk-message lk-${msg.role}${live ? " lk-live" : ""}`, "data-role": msg.role },
    h("div", { className: "lk-role" }, assistant ? "Assistant" : msg.role === "user" ? "You" : msg.role),
    msg.reasoning
      ? h("details", { className: "lk-reasoning" }, h("summary", {}, "Reasoning"), h("pre", {}, msg.reasoning))
      : null,
    h("div", { className: "lk-content" }, msg.content),
    msg.stopped ? h("div", { className: "lk-note" }, "stopped") : null,
    assistant && !live ? copyButton(msg.content, index) : null,
  );
}

function render({ model, el }) {
  const [picker, pickerView] = modelPickerView(model, "Chat model");
  const [banner, bannerView] = errorView(model);
  const history = h("div", { className: "lk-history", role: "log", "aria-label": "Conversation", "aria-live": "polite" });
  const input = h("textarea", { className: "lk-input", rows: "2", "aria-label": "Message", placeholder: "Ask something" });
  const send = () => {
    const text = input.value.trim();
    if (!text || model.get("streaming")) return;
    act(model, "send", text);
    input.value = "";
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      send();
    }
  });
  const sendButton = button("Send", "Send message", send);
  const stopButton = button("Stop", "Stop generating", () => act(model, "stop"));
  const clearButton = button("Clear", "Clear the conversation", () => act(model, "clear"));
  el.classList.add("lk-widget", "lk-chat-panel");
  el.append(
    h("div", { className: "lk-toolbar" }, picker, button("Refresh", "Refresh the model list", () => act(model, "refresh_models"))),
    banner,
    history,
    h("div", { className: "lk-compose" }, input, sendButton, stopButton, clearButton),
  );

  const views = {
    // the picker only when its choices change: a re-rendered <select> would close under the user's pointer
    picker: pickerView,
    banner: bannerView,
    history: () => {
      const streaming = model.get("streaming");
      const partial = model.get("partial");
      rerender(
        history,
        model.get("messages").map((m, i) => message(m, i)),
        streaming && partial ? message({ role: "assistant", ...partial }, -1, true) : null,
      );
      history.scrollTop = history.scrollHeight;
      sendButton.disabled = streaming;
      stopButton.disabled = !streaming;
      el.dataset.streaming = String(streaming);
    },
  };
  return watch(model, {
    models: views.picker,
    model: views.picker,
    error: views.banner,
    messages: views.history,
    partial: views.history,
    streaming: views.history,
  });
}

export default { render };
