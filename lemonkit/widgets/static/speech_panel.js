import { act, actWith, audioPlayer, button, bytesUrl, choicePicker, errorBanner, h, modelPicker, rerender } from "./shared.js";

function render({ model, el }) {
  el.classList.add("lk-widget", "lk-speech-panel");
  const picker = h("span");
  const voice = h("span");
  const banner = h("div", { className: "lk-banner" });
  const status = h("span", { className: "lk-note", role: "status", "aria-live": "polite" });
  const text = h("textarea", { className: "lk-speech-text", rows: "3", "aria-label": "Text to speak" });
  const speed = h("input", { type: "range", min: "0.5", max: "2", step: "0.05", "aria-label": "Speed" });
  const speedValue = h("output", {});
  const player = audioPlayer("Speech");
  const download = h("a", { className: "lk-button", download: "speech.wav", "aria-label": "Download the speech as WAV" }, "Download");
  const urls = { audio: {} };

  const save = (name, value) => {
    model.set(name, value);
    model.save_changes();
  };
  text.addEventListener("change", () => save("text", text.value));
  speed.addEventListener("input", () => {
    speedValue.textContent = `${Number(speed.value).toFixed(2)}×`;
    save("speed", Number(speed.value));
  });
  const speak = button("Speak", "Speak the text", () => {
    if (text.value.trim()) actWith(model, { speed: Number(speed.value) }, "speak", text.value);
  });

  el.append(
    h(
      "div",
      { className: "lk-toolbar" },
      picker,
      voice,
      h("label", { className: "lk-speed" }, "Speed", speed, speedValue),
      button("Refresh", "Refresh the model list", () => act(model, "refresh_models")),
    ),
    banner,
    text,
    h("div", { className: "lk-toolbar" }, speak, status, download),
    player,
  );

  const views = {
    picker: () => rerender(picker, modelPicker(model.get("models"), model.get("model"), (id) => save("model", id), "Speech model")),
    voice: () =>
      rerender(voice, choicePicker(model.get("voices"), model.get("voice"), (v) => save("voice", v), "Voice", "voice", "no voices")),
    banner: () => rerender(banner, errorBanner(model.get("error"), () => act(model, "dismiss"))),
    text: () => {
      if (text.value !== model.get("text")) text.value = model.get("text");
    },
    speed: () => {
      speed.value = String(model.get("speed"));
      speedValue.textContent = `${model.get("speed").toFixed(2)}×`;
    },
    status: () => {
      const busy = model.get("busy");
      el.dataset.busy = String(busy);
      speak.disabled = busy;
      status.textContent = busy ? "Speaking…" : "";
    },
    audio: () => {
      const url = bytesUrl(urls.audio, model.get("audio"), model.get("audio_type"));
      if (url) player.src = url;
      else player.removeAttribute("src");
      player.hidden = !url;
      download.hidden = !url;
      if (url) download.href = url;
      else download.removeAttribute("href");
    },
  };
  const triggers = {
    models: views.picker,
    model: views.picker,
    voices: views.voice,
    voice: views.voice,
    error: views.banner,
    text: views.text,
    speed: views.speed,
    busy: views.status,
    audio: views.audio,
    audio_type: views.audio,
  };
  for (const [name, view] of Object.entries(triggers)) model.on(`change:${name}`, view);
  Object.values(views).forEach((view) => view());
  return () => {
    Object.entries(triggers).forEach(([name, view]) => model.off(`change:${name}`, view));
    if (urls.audio.url) URL.revokeObjectURL(urls.audio.url);
  };
}

export default { render };
