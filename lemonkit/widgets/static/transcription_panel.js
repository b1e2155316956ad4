import { act, audioPlayer, button, bytesUrl, errorView, h, modelPickerView, pageError, rerender, showUrl, watch } from "./shared.js";

// The index of the word playing at time t: the last one started by then (-1 before the first).
function wordAt(words, t) {
  let index = -1;
  for (let i = 0; i < words.length && words[i].start <= t; i++) index = i;
  return index;
}

function describe(transcript) {
  if (!transcript) return "";
  const facts = [`${transcript.words.length} words`, transcript.language];
  if (transcript.duration) facts.push(`${transcript.duration.toFixed(1)} s of audio`);
  return facts.filter((f) => f).join(" · ");
}

function render({ model, el }) {
  el.classList.add("lk-widget", "lk-transcription-panel");
  const [picker, pickerView] = modelPickerView(model, "Transcription model");
  const [banner, bannerView] = errorView(model);
  const status = h("span", { className: "lk-note", role: "status", "aria-live": "polite" });
  const file = h("input", { type: "file", accept: "audio/*,video/webm", "aria-label": "Audio file to transcribe" });
  const player = audioPlayer("Transcribed audio");
  const words = h("div", { className: "lk-words", role: "group", "aria-label": "Transcript" });
  const plot = h("img", { className: "lk-plot", alt: "Word timing plot: each word's time over the waveform" });
  const urls = { audio: {}, plot: {} };
  let spans = [];
  let current = -1;
  let recorder = null;

  const upload = (name, type, data) => model.send({ action: "transcribe_upload", args: [name, type] }, undefined, [data]);

  file.addEventListener("change", async () => {
    const chosen = file.files[0];
    if (!chosen) return;
    upload(chosen.name, chosen.type, await chosen.arrayBuffer());
    file.value = "";
  });

  const record = button("Record", "Record from the microphone", () => (recorder ? recorder.stop() : startRecording()));
  async function startRecording() {
    let stream;
    try {
      stream = await navigator.mediaDevices.getUserMedia({ audio: true });
    } catch (e) {
      pageError(model, `The microphone is not available: ${e.message}`, "microphone_unavailable");
      return;
    }
    const chunks = [];
    const started = performance.now();
    recorder = new MediaRecorder(stream);
    recorder.addEventListener("dataavailable", (e) => {
      if (e.data.size) chunks.push(e.data);
      const ms = Math.round(performance.now() - started);
      el.dataset.recordedMs = String(ms);
      if (recorder) status.textContent = `Recording… ${(ms / 1000).toFixed(1)} s`;
    });
    recorder.addEventListener("stop", async () => {
      stream.getTracks().forEach((track) => track.stop());
      const type = recorder.mimeType || "audio/webm";
      recorder = null;
      recording(false);
      upload("recording.webm", type, await new Blob(chunks, { type }).arrayBuffer());
    });
    recorder.start(250); // a chunk every 250 ms: the elapsed time shows while recording
    el.dataset.recordedMs = "0";
    recording(true);
  }
  function recording(on) {
    el.dataset.recording = String(on);
    record.textContent = on ? "Stop" : "Record";
    record.setAttribute("aria-label", on ? "Stop recording and transcribe" : "Record from the microphone");
    if (on) status.textContent = "Recording…";
  }

  const highlight = () => {
    const transcript = model.get("transcript");
    const index = transcript ? wordAt(transcript.words, player.currentTime) : -1;
    if (index === current) return;
    spans[current]?.classList.remove("lk-current");
    spans[current]?.removeAttribute("aria-current");
    current = index;
    spans[current]?.classList.add("lk-current");
    spans[current]?.setAttribute("aria-current", "true");
    el.dataset.currentWord = String(current);
  };
  for (const event of ["timeupdate", "seeked", "loadedmetadata"]) player.addEventListener(event, highlight);

  el.append(
    h(
      "div",
      { className: "lk-toolbar" },
      picker,
      button("Refresh", "Refresh the model list", () => act(model, "refresh_models")),
      file,
      record,
      status,
    ),
    banner,
    player,
    words,
    plot,
  );

  const views = {
    picker: pickerView,
    banner: bannerView,
    status: () => {
      const busy = model.get("busy");
      el.dataset.busy = String(busy);
      el.dataset.source = model.get("source");
      file.disabled = busy;
      record.disabled = busy && !recorder;
      if (!recorder) status.textContent = busy ? `Transcribing ${model.get("source")}…` : describe(model.get("transcript"));
    },
    audio: () => {
      showUrl(player, bytesUrl(urls.audio, model.get("audio"), model.get("audio_type")));
    },
    words: () => {
      const transcript = model.get("transcript");
      spans = (transcript?.words || []).map((w, i) => {
        const confidence = w.confidence === null ? "" : ` · confidence ${Math.round(w.confidence * 100)}%`;
        return h(
          "span",
          {
            className: "lk-word",
            "data-index": String(i),
            title: `${w.start.toFixed(2)} to ${w.end.toFixed(2)} s${confidence}`,
            onclick: () => (player.currentTime = w.start),
          },
          w.word,
        );
      });
      current = -1;
      rerender(words, spans.flatMap((span) => [span, " "]));
      el.dataset.words = String(spans.length);
      highlight();
    },
    plot: () => {
      showUrl(plot, bytesUrl(urls.plot, model.get("plot"), "image/png"));
    },
  };
  const unwatch = watch(model, {
    models: views.picker,
    model: views.picker,
    error: views.banner,
    busy: views.status,
    source: views.status,
    transcript: [views.words, views.status],
    audio: views.audio,
    audio_type: views.audio,
    plot: views.plot,
  });
  return () => {
    unwatch();
    recorder?.stop();
    Object.values(urls).forEach((slot) => slot.url && URL.revokeObjectURL(slot.url));
  };
}

export default { render };
