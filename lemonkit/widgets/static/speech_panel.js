import { act, actWith, audioPlayer, button, bytesUrl, choicePicker, errorView, h, modelPickerView, rerender, setTrait, showUrl, watch } from "./shared.js";

function render({ model, el }) {
  el.classList.add("lk-widget", "lk-speech-panel");
  const [picker, pickerView] = modelPickerView(model, "Speech model");
  const voice = h("span");
  const [banner, bannerView] = errorView(model);
  const status = h("span", { className: "lk-note", role: "status", "aria-live": "polite" });
  const text = h("textarea", { className: "lk-speech-text", rows: "3", "aria-label": "Text to speak" });
  const speed = h("input", { type: "range", min: "0.5", max: "2", step: "0.05", "aria-label": "Speed" });
  const speedValue = h("output", {});
  const player = audioPlayer("Speech");
  const download = h("a", { className: "lk-button", download: "speech.wav", "aria-label": "Download the speech as WAV" }, "Download");
  const urls = { audio: {} };

  const save = (name, value) => setTrait(model, name, value);
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
    picker: pickerView,
    voice: () =>
      rerender(voice, choicePicker(model.get("voices"), model.get("voice"), (v) => save("voice", v), "Voice", "voice", "no voices")),
    banner: bannerView,
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
      showUrl(player, url);
      showUrl(download, url, "href");
    },
  };
  const unwatch = watch(model, {
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
  });
  return () => {
    unwatch();
    if (urls.audio.url) URL.revokeObjectURL(urls.audio.url);
  };
}

export default { render };
