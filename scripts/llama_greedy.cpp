// llama.cpp's greedy continuation as token ids: the reference the parity tests compare with.
//
// llama-simple prints text only, and re-tokenizing its text need not give back the tokens it chose, so
// this is llama-simple's loop (same API calls, same greedy sampler) printing ids instead of pieces. The
// prompt is given as text (tokenized by llama.cpp, with its special tokens parsed, as llama-simple does)
// or as ids; end-of-generation tokens do not stop it, so it always prints n ids.
//
// Usage: llama-greedy -m FILE -n N [-t THREADS] (-p TEXT | -i ID,ID,...)
// Prints:  prompt: ID ID ...   (the ids it ran)
//          tokens: ID ID ...   (the n greedy ids)
#include "llama.h"

#include <clocale>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static void batch_set_tokens(llama_batch_ext * batch, const llama_token * tokens, int32_t n_tokens, llama_pos pos_0) {
    llama_batch_ext_clear(batch);
    for (int32_t i = 0; i < n_tokens; ++i) {
        const int32_t idx = llama_batch_ext_add_token(batch, 0, tokens[i]);
        const llama_pos pos = pos_0 + i;
        llama_batch_ext_set_pos(batch, idx, &pos);
    }
    llama_batch_ext_set_output_logits(batch, n_tokens - 1, true);
}

static int usage(const char * argv0) {
    fprintf(stderr, "usage: %s -m FILE -n N [-t THREADS] (-p TEXT | -i ID,ID,...)\n", argv0);
    return 2;
}

static void print_ids(const char * label, const std::vector<llama_token> & ids) {
    printf("%s:", label);
    for (llama_token id : ids) {
        printf(" %d", id);
    }
    printf("\n");
}

int main(int argc, char ** argv) {
    std::setlocale(LC_NUMERIC, "C");
    std::string model_path, text, ids_arg;
    bool have_text = false;
    int n_predict = -1, n_threads = 0;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "-m")) {
            model_path = argv[i + 1];
        } else if (!strcmp(argv[i], "-n")) {
            n_predict = atoi(argv[i + 1]);
        } else if (!strcmp(argv[i], "-t")) {
            n_threads = atoi(argv[i + 1]);
        } else if (!strcmp(argv[i], "-p")) {
            text = argv[i + 1];
            have_text = true;
        } else if (!strcmp(argv[i], "-i")) {
            ids_arg = argv[i + 1];
        } else {
            return usage(argv[0]);
        }
    }
    if (argc % 2 == 0 || model_path.empty() || n_predict < 1 || have_text == !ids_arg.empty()) {
        return usage(argv[0]);
    }

    llama_log_set([](ggml_log_level level, const char * msg, void *) {
        if (level >= GGML_LOG_LEVEL_ERROR) {
            fputs(msg, stderr);
        }
    }, nullptr);
    llama_backend_init();
    llama_model_params model_params = llama_model_default_params();
    model_params.n_gpu_layers = 0;
    model_params.progress_callback = [](float, void *) { return true; };  // no loading dots on stderr
    llama_model * model = llama_model_load_from_file(model_path.c_str(), model_params);
    if (model == NULL) {
        fprintf(stderr, "error: unable to load model %s\n", model_path.c_str());
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);

    std::vector<llama_token> prompt;
    if (have_text) {
        const int n = -llama_tokenize(vocab, text.c_str(), text.size(), NULL, 0, true, true);
        prompt.resize(n);
        if (llama_tokenize(vocab, text.c_str(), text.size(), prompt.data(), prompt.size(), true, true) < 0) {
            fprintf(stderr, "error: failed to tokenize the prompt\n");
            return 1;
        }
    } else {
        for (const char * p = ids_arg.c_str(); *p; ) {
            char * end;
            long id = strtol(p, &end, 10);
            if (end == p || id < 0 || id >= llama_vocab_n_tokens(vocab)) {
                fprintf(stderr, "error: bad token id list %s\n", ids_arg.c_str());
                return 2;
            }
            prompt.push_back((llama_token) id);
            p = *end == ',' ? end + 1 : end;
        }
    }
    if (prompt.empty()) {
        fprintf(stderr, "error: empty prompt\n");
        return 2;
    }

    llama_context_params ctx_params = llama_context_default_params();
    ctx_params.n_ctx = prompt.size() + n_predict;
    ctx_params.n_batch = prompt.size();
    if (n_threads > 0) {
        ctx_params.n_threads = n_threads;
        ctx_params.n_threads_batch = n_threads;
    }
    llama_context * ctx = llama_init_from_model(model, ctx_params);
    if (ctx == NULL) {
        fprintf(stderr, "error: failed to create the llama_context\n");
        return 1;
    }
    llama_sampler * smpl = llama_sampler_chain_init(llama_sampler_chain_default_params());
    llama_sampler_chain_add(smpl, llama_sampler_init_greedy());

    llama_batch_ext * batch = llama_batch_ext_init(ctx);
    batch_set_tokens(batch, prompt.data(), prompt.size(), 0);
    std::vector<llama_token> out;
    llama_pos n_pos = 0;
    int32_t n_tokens = prompt.size();
    while ((int) out.size() < n_predict) {
        if (llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch)) {
            fprintf(stderr, "error: failed to eval\n");
            return 1;
        }
        n_pos += n_tokens;
        llama_token id = llama_sampler_sample(smpl, ctx, -1);
        out.push_back(id);
        batch_set_tokens(batch, &id, 1, n_pos);
        n_tokens = 1;
    }
    print_ids("prompt", prompt);
    print_ids("tokens", out);

    llama_batch_ext_free(batch);
    llama_sampler_free(smpl);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
